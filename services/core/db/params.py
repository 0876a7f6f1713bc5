"""How core's queries take values that the driver does not adapt by itself."""

from __future__ import annotations

from typing import Any

import orjson


def jsonb(value: Any) -> str:
    """``value`` as JSON text, for a parameter the query casts to ``jsonb``."""
    return orjson.dumps(value).decode()
