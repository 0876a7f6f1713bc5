"""Notification rules: the signature, what a try's answer means, when to try again, and
when a subscription is switched off."""

from __future__ import annotations

import hashlib
import hmac
import random
import secrets
import time
from dataclasses import dataclass

from services.core.domain.retry import Backoff

SIGNATURE_HEADER = "X-Cairn-Signature"
DELIVERY_HEADER = "X-Cairn-Delivery"
TIMESTAMP_HEADER = "X-Cairn-Timestamp"
EVENT_HEADER = "X-Cairn-Event"
TEST_EVENT = "test"
SECRET_PREFIX = "whsec_"  # noqa: S105 - a prefix, not a secret


def new_secret() -> str:
    """A signing secret: 32 random bytes, URL-safe."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


#: the scheme a signature is made with, its header value's prefix: receivers tell a
#: change of scheme by it (the body-only ``sha256=`` of before 0009 is gone)
SIGNATURE_VERSION = "v1"
#: how far a receiver lets a signed timestamp be from its clock (replays are older)
TOLERANCE_S = 300


def signed_string(timestamp: int, body: bytes) -> bytes:
    """What is signed: the ``X-Cairn-Timestamp`` value, a dot, then the raw body."""
    return str(timestamp).encode() + b"." + body


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Cairn-Signature`` value: ``v1=`` and the hex HMAC-SHA256, keyed with the
    secret, of :func:`signed_string`."""
    digest = hmac.new(secret.encode(), signed_string(timestamp, body), hashlib.sha256)
    return f"{SIGNATURE_VERSION}={digest.hexdigest()}"


def verify(
    secret: str,
    body: bytes,
    timestamp: str,
    header: str,
    now: float | None = None,
    tolerance_s: float = TOLERANCE_S,
) -> bool:
    """What a receiver checks: ``timestamp`` (the ``X-Cairn-Timestamp`` header) is within
    ``tolerance_s`` of ``now``, and ``header`` is the signature of it and the body: an
    old request sent again, or its body under a new timestamp, does not pass."""
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        return False
    at = int(timestamp)
    if abs((time.time() if now is None else now) - at) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, at, body), header)


def secret_context(owner: str, name: str) -> bytes:
    """The associated data a subscription's signing secret is sealed with (owner and
    name, which never change): a sealed secret copied to another row does not open."""
    return f"cairn-webhook-secret\x00{owner}\x00{name}".encode()


@dataclass(frozen=True)
class Policy:
    """How deliveries are retried and when a subscription is disabled."""

    backoff: Backoff
    max_tries: int
    disable_after: int

    def delivered(self, status: int | None) -> bool:
        return status is not None and 200 <= status < 300

    def retry_in_s(
        self, tries: int, event: str = "", rng: random.Random | None = None
    ) -> float | None:
        """Seconds until the next try after ``tries`` failed ones; None: give up. A
        ``test`` delivery is tried once: its owner asks again if they want."""
        if tries >= self.max_tries or event == TEST_EVENT:
            return None
        return self.backoff.delay_s(tries, rng)

    def disables(self, failures: int) -> bool:
        """Whether ``failures`` failed tries in a row switch the subscription off."""
        return failures >= self.disable_after


def disabled_reason(failures: int, status: int | None, error: str | None) -> str:
    last = f"HTTP {status}" if status is not None else (error or "no answer")
    return f"disabled after {failures} failed deliveries in a row; last: {last}"[:1000]
