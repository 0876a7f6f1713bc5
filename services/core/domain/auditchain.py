"""The audit trail's hash chain (docs/security.md, "Audit export"): each row stores
``prev_hash`` and ``hash = sha256(prev_hash || canonical JSON of the row's content)``, so
an edited, removed or inserted row breaks every link after it. The canonical form and the
verifier live here, once: the writer (``db.audit``), the migration that chained the rows
written before, the export and ``cairn audit verify`` all use them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

#: The chain's anchor: the ``prev_hash`` of the first row ever written.
GENESIS = "0" * 64

#: What a row's hash covers, and what an export line holds besides the two hashes.
FIELDS = ("id", "at", "actor", "actor_role", "action", "target", "source", "before", "after")


def stamp(at: datetime) -> str:
    """A row's time as the chain covers it: UTC, ISO 8601, to the microsecond."""
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def content(row: Mapping[str, Any]) -> dict[str, Any]:
    """The hashed fields of a database row (``at`` a datetime) or of an export line."""
    out = {name: row[name] for name in FIELDS}
    if isinstance(out["at"], datetime):
        out["at"] = stamp(out["at"])
    return out


def canonical(fields: Mapping[str, Any]) -> bytes:
    """Sorted keys, no spaces, UTF-8: the same bytes for the same content everywhere."""
    return orjson.dumps(dict(fields), option=orjson.OPT_SORT_KEYS)


def link(prev_hash: str, row: Mapping[str, Any]) -> str:
    return hashlib.sha256(prev_hash.encode() + canonical(content(row))).hexdigest()


def line(row: Mapping[str, Any]) -> bytes:
    """One export line (JSON, newline-terminated): the content and both hashes."""
    return canonical({**content(row), "prev_hash": row["prev_hash"], "hash": row["hash"]}) + b"\n"


@dataclass(frozen=True)
class Verdict:
    """What ``verify`` found: how many rows held, and the first break (``None``: none)."""

    rows: int
    first_id: int | None
    last_id: int | None
    problem: str | None = None
    at_line: int | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def verify(lines: Iterable[bytes | str], anchor: str | None = None) -> Verdict:
    """Recompute the chain over export lines. The first line's ``prev_hash`` is trusted
    unless ``anchor`` says what it must be (``GENESIS`` for a trail never purged): the
    start of an export follows rows it does not hold. Reports the first line whose hash
    does not match its content (an edit) or whose ``prev_hash`` is not the hash before it
    (a row removed, inserted or reordered)."""
    prev, count, first, last = anchor, 0, None, None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = orjson.loads(raw)
            row_id, claimed, before = int(row["id"]), str(row["hash"]), str(row["prev_hash"])
            computed = link(before, row)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return Verdict(count, first, last, f"line {number}: not an audit row ({exc})", number)
        if prev is not None and before != prev:
            return Verdict(
                count,
                first,
                last,
                f"row {row_id}: prev_hash does not match the row before it"
                f" (after row {last}): a row is missing, added or out of order",
                number,
            )
        if computed != claimed:
            return Verdict(
                count, first, last, f"row {row_id}: hash does not match its content: edited", number
            )
        prev, count, last = claimed, count + 1, row_id
        first = row_id if first is None else first
    return Verdict(count, first, last)
