"""What a ``Cache-Control`` value says of how long an answer may be kept or how old it may
be (RFC 9111 5.2): its ``max-age``, unless ``no-cache`` or ``no-store`` asks for a fresh
one. Core reads it on the identity provider's key set (``identity.oidc``) and on the
requests for the backlog's counts (``api.deps.max_age_of``)."""

from __future__ import annotations

import re

#: ``max-age=N``, N bare or quoted, as one whole directive
_MAX_AGE = re.compile(
    r'(?:^|,)\s*max-age\s*=\s*(?:([0-9]{1,10})|"([0-9]{1,10})")\s*(?=,|$)', re.IGNORECASE
)
#: the directives that ask for a fresh answer whatever ``max-age`` says (5.2.1.4, 5.2.1.5)
_FRESH = re.compile(r"(?:^|,)\s*(?:no-cache|no-store)\s*(?=,|$|=)", re.IGNORECASE)


def lifetime(header: str | None) -> float | None:
    """The seconds ``header`` lets an answer be kept, or be old: its ``max-age``, 0 with
    ``no-cache`` or ``no-store``; None when it says neither (or nothing)."""
    if header is None:
        return None
    if _FRESH.search(header):
        return 0.0
    found = _MAX_AGE.search(header)
    return float(found.group(1) or found.group(2)) if found else None
