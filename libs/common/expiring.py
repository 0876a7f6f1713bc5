"""A bounded map whose entries expire: what a replica keeps of an answer it read (a
token's principal, a worker's lease, whether an owner is disabled) for a while, so that a
hot path does not read it again. Full, it starts over empty (the entries are cheap to
read again; no eviction order to keep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Expiring(Generic[K, V]):
    """Entries kept ``ttl_s`` each (or as long as ``put`` says), at most ``size`` of them;
    a ``ttl_s`` of 0 keeps nothing."""

    def __init__(
        self, ttl_s: float, size: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self.clock = clock
        self._entries: dict[K, tuple[float, V]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value kept for ``key``, if it has not expired."""
        entry = self._entries.get(key)
        if entry is None or entry[0] < self.clock():
            return None
        return entry[1]

    def put(self, key: K, value: V, keep_s: float | None = None) -> None:
        """Keep ``value`` for ``keep_s`` (default ``ttl_s``); nothing when that is 0."""
        keep = self.ttl_s if keep_s is None else keep_s
        if keep <= 0:
            return
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[key] = (self.clock() + keep, value)

    def forget(self, key: K) -> None:
        self._entries.pop(key, None)

    def forget_where(self, drop: Callable[[K, V], bool]) -> None:
        """Forget every entry ``drop`` says to."""
        for key in [k for k, (_, v) in self._entries.items() if drop(k, v)]:
            del self._entries[key]
