"""The secrets keys' one rule (``CAIRN_SECRETS_KEY``, the key file's lines): 32 bytes of
URL-safe base64. Read by core's settings, which refuse a bad key at start, and by the
sealing itself (``identity.crypto``)."""

from __future__ import annotations

import base64
import binascii


class BadKey(ValueError):
    """A key is missing, unreadable, or not 32 bytes of URL-safe base64."""


def decode_key(text: str) -> bytes:
    try:
        key = base64.urlsafe_b64decode(text.strip().encode())
    except (binascii.Error, ValueError):
        raise BadKey("a secrets key must be URL-safe base64") from None
    if len(key) != 32:
        raise BadKey("a secrets key must be 32 bytes (44 characters of base64)")
    return key


def key_list(text: str) -> list[str]:
    """The keys of ``CAIRN_SECRETS_KEY`` or of a key file: separated by commas or white
    space, the sealing one first."""
    return [key for key in text.replace(",", " ").split() if key]
