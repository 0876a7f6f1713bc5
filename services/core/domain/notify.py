"""Notification rules: the signature, what a try's answer means, when to try again, and
when a subscription is switched off."""

from __future__ import annotations

import hashlib
import hmac
import random
import secrets
from dataclasses import dataclass

from services.core.domain.retry import Backoff

SIGNATURE_HEADER = "X-Cairn-Signature"
DELIVERY_HEADER = "X-Cairn-Delivery"
TIMESTAMP_HEADER = "X-Cairn-Timestamp"
EVENT_HEADER = "X-Cairn-Event"
SECRET_PREFIX = "whsec_"  # noqa: S105 - a prefix, not a secret


def new_secret() -> str:
    """A signing secret: 32 random bytes, URL-safe."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, body: bytes) -> str:
    """The ``X-Cairn-Signature`` value: ``sha256=`` and the hex HMAC-SHA256 of the body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str) -> bool:
    """What a receiver checks: the header is the body's signature under ``secret``."""
    return hmac.compare_digest(signature(secret, body), header)


@dataclass(frozen=True)
class Policy:
    """How deliveries are retried and when a subscription is disabled."""

    backoff: Backoff
    max_tries: int
    disable_after: int

    def delivered(self, status: int | None) -> bool:
        return status is not None and 200 <= status < 300

    def retry_in_s(self, tries: int, rng: random.Random | None = None) -> float | None:
        """Seconds until the next try after ``tries`` failed ones; None: give up."""
        if tries >= self.max_tries:
            return None
        return self.backoff.delay_s(tries, rng)

    def disables(self, failures: int) -> bool:
        """Whether ``failures`` failed tries in a row switch the subscription off."""
        return failures >= self.disable_after


def disabled_reason(failures: int, status: int | None, error: str | None) -> str:
    last = f"HTTP {status}" if status is not None else (error or "no answer")
    return f"disabled after {failures} failed deliveries in a row; last: {last}"[:1000]
