"""The allow-list of artifact sources (``CAIRN_ARTIFACT_SOURCES``): URI prefixes such as
``s3://jobs-bucket/,https://artifacts.corp/``. Core checks it at submit and every worker
agent checks it again before it fetches anything."""

from __future__ import annotations

import re
import urllib.parse


def parse_sources(text: str) -> tuple[str, ...]:
    """The prefixes of a comma-separated list. Each must name a scheme and end with ``/``,
    so ``https://artifacts.corp/`` cannot be read as ``https://artifacts.corp.evil/``."""
    prefixes = tuple(item.strip() for item in text.split(",") if item.strip())
    for prefix in prefixes:
        scheme, sep, rest = prefix.partition("://")
        if not sep or not scheme or not prefix.endswith("/") or (scheme != "file" and not rest):
            raise ValueError(
                f"artifact source {prefix!r} must be a URI prefix ending with '/', "
                "such as s3://bucket/ or https://host/path/"
            )
    return prefixes


def source_allowed(uri: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``uri`` lies under one of ``prefixes`` (no prefixes: every source is open).
    A path with ``.`` or ``..`` segments, encoded or not, never matches."""
    if not prefixes:
        return True
    path = urllib.parse.urlsplit(uri).path
    segments = urllib.parse.unquote(path).replace("\\", "/").split("/")
    if any(segment in (".", "..") for segment in segments):
        return False
    return any(uri.startswith(prefix) for prefix in prefixes)


def redact_url(uri: str) -> str:
    """``uri`` as it may be shown in an error or a log: a ``user:password@`` masked as
    ``***@``, the query and fragment dropped (presigned URLs carry their credentials
    there). Text that is not a URL has any ``...@`` before its first ``/`` masked."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "", uri
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    shown = f"{scheme}{sep}{authority}{slash}{path}"
    return re.split(r"[?#]", shown, maxsplit=1)[0]
