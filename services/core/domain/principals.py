"""A caller as core knows it (the principal behind a token, or one an identity provider
vouches for), and the roles there are."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from libs.common.auth import Caller

ROLES = ("admin", "service", "user", "worker")


@dataclass(frozen=True, kw_only=True)
class Principal(Caller):
    """A caller as core knows it: the id of its row (None for one an identity provider
    vouches for) and of the token it came with."""

    id: int | None = None
    token_id: int | None = None
    #: for one an identity provider vouches for: the id of the key that signed its token,
    #: and until when the teams it claims are kept for the leases of what it submits
    #: (its expiry, ``CAIRN_OIDC_CLAIM_MAX_S`` after it was checked at most)
    key_id: str | None = None
    claims_until: datetime | None = None
    #: the teams the provider's groups claim (``teams`` adds those an admin recorded),
    #: and until when they stand for what a service does in its name
    #: (``CAIRN_OIDC_CLAIM_SEEN_S`` after this token was checked)
    claimed: frozenset[str] = frozenset()
    claims_standing: datetime | None = None
