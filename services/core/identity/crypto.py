"""Secret values at rest: AES-256-GCM (``cryptography``), each value bound to its scope and
name as associated data, so a ciphertext copied to another row does not open there.

Keys are 32 random bytes, written as URL-safe base64, from ``CAIRN_SECRETS_KEY`` (a comma
separated list) or the file ``CAIRN_SECRETS_KEY_FILE`` (one a line). The first encrypts;
every one decrypts, so a key is rotated by putting a new one first, then moving every
sealed value to it (``ops.rekey``, ``cairn secret rekey``), then dropping the old one.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from services.core.domain.keys import BadKey, decode_key, key_list


class Unreadable(Exception):
    """A stored value does not open with any configured key."""


def new_key() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"cairn-secrets-key:" + key).hexdigest()[:12]


def read_key_file(path: Path, create: bool) -> list[str]:
    """The keys in ``path``; with ``create``, a new file (mode 0600) with one fresh key if
    there is none yet."""
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another replica made it first: read that one
        else:
            with os.fdopen(fd, "w") as out:
                out.write(new_key() + "\n")
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadKey(f"cannot read the secrets key file {path}: {exc.strerror}") from None
    return key_list(text)


class SecretBox:
    """Seals and opens secret values with the configured keys."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise BadKey("no secrets key configured")
        raw = [decode_key(k) for k in keys]
        self.current = key_id(raw[0])
        self._ciphers = {key_id(k): AESGCM(k) for k in raw}

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Every configured key's id, the sealing one first."""
        return tuple(self._ciphers)

    def seal(self, value: str, context: bytes) -> tuple[str, bytes, bytes]:
        """(key id, nonce, ciphertext) of ``value``, bound to ``context``."""
        nonce = secrets.token_bytes(12)
        sealed = self._ciphers[self.current].encrypt(nonce, value.encode(), context)
        return self.current, nonce, sealed

    def open(self, kid: str, nonce: bytes, sealed: bytes, context: bytes) -> str:
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise Unreadable(f"sealed with key {kid}, which is not configured")
        try:
            return cipher.decrypt(nonce, sealed, context).decode()
        except InvalidTag:
            raise Unreadable("the value does not match its key or its place") from None
