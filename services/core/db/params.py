"""How core's queries take values that the driver does not adapt by itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson


def jsonb(value: Any) -> str:
    """``value`` as JSON text, for a parameter the query casts to ``jsonb`` or ``json``."""
    return orjson.dumps(value).decode()


# Arrays as their text literals, for a parameter the query casts to an array type
# (``CAST(:ids AS bigint[])``): psycopg dumps a list element by element in Python, 72 µs
# for 64 ids and 150-190 µs for 64 floats or words on this machine (loaded), against
# 14-30 µs for the literal. Only where the statement reads the array once (an index
# condition, ``unnest``) and has no other plan to choose: the lease's five arrays. The
# reported attempts' read (``attempts._REPORTED``) given its ids so ran 4 times longer
# and read a page more a row than given the list (pg_stat_statements, 5,000 tasks).


def ints(values: Iterable[int]) -> str:
    """A ``bigint[]`` (or ``integer[]``) parameter (``int.__repr__``: a non-int fails)."""
    return "{" + ",".join(map(int.__repr__, values)) + "}"


def floats(values: Iterable[float]) -> str:
    """A ``float8[]`` parameter (``float.__repr__``: every digit, ``inf`` and ``nan``
    as such; a non-float fails)."""
    return "{" + ",".join(map(float.__repr__, values)) + "}"


def words(values: Iterable[str | None]) -> str:
    """A ``text[]`` (or ``jsonb[]``, of JSON texts) parameter: each quoted, ``"`` and
    ``\\`` escaped; None is NULL."""
    return "{" + ",".join(map(_word, values)) + "}"


def _word(value: str | None) -> str:
    if value is None:
        return "NULL"
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
