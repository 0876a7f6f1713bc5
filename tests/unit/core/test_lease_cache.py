"""The worker-lease cache: a hit only for the lease checked, for its time, never a miss
cached."""

from __future__ import annotations

from services.core.api.deps import LeaseCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_checked_lease_is_trusted_for_its_time_and_no_other_lease_is() -> None:
    clock = Clock()
    cache = LeaseCache(60.0, clock=clock)
    assert cache.principal_of(7, "secret") is None
    cache.put(7, "secret", "agent")
    assert cache.principal_of(7, "secret") == "agent"
    assert cache.principal_of(7, "secreT") is None
    assert cache.principal_of(7, None) is None
    assert cache.principal_of(8, "secret") is None
    clock.now += 60.5
    assert cache.principal_of(7, "secret") is None


def test_no_caching_with_a_zero_ttl_or_without_a_lease() -> None:
    off = LeaseCache(0.0)
    off.put(7, "secret", "agent")
    assert off.principal_of(7, "secret") is None
    on = LeaseCache(60.0)
    on.put(7, None, "agent")
    assert on.principal_of(7, "") is None


def test_a_full_cache_starts_again_rather_than_growing() -> None:
    cache = LeaseCache(60.0, size=2)
    for worker_id in (1, 2, 3):
        cache.put(worker_id, f"lease-{worker_id}", "agent")
    assert len(cache._kept) <= 2
    assert cache.principal_of(3, "lease-3") == "agent"
