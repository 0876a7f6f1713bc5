"""The retry curve (``services.core.domain.retry.Backoff``): Sidekiq's curve by default,
``n**4 + 15 + rand(10) * (n + 1)`` for the n-th retry (n = failures - 1), or
``base * 2**n`` with equal jitter; both capped."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.domain.retry import Backoff

FAILURES = st.integers(min_value=1, max_value=200)
SEEDS = st.integers(min_value=0, max_value=2**32 - 1)
CAPS = st.floats(min_value=0.001, max_value=30 * 86400, allow_nan=False)
BASES = st.floats(min_value=0.001, max_value=86400, allow_nan=False)


def _sidekiq(failures: int) -> int:
    n = failures - 1
    return n**4 + 15


@pytest.mark.parametrize(
    ("failures", "expected"),
    [(1, 15.0), (2, 16.0), (3, 31.0), (4, 96.0), (5, 271.0), (25, 331791.0)],
)
def test_sidekiq_curve_without_jitter_is_n4_plus_15(failures: int, expected: float) -> None:
    assert Backoff(jitter=False, cap_s=10**9).delay_s(failures) == expected


def test_zero_failures_counts_as_the_first() -> None:
    assert Backoff(jitter=False).delay_s(0) == Backoff(jitter=False).delay_s(1) == 15.0


@given(failures=FAILURES, seed=SEEDS)
def test_sidekiq_jitter_is_rand10_times_n_plus_1(failures: int, seed: int) -> None:
    n = failures - 1
    spread = random.Random(seed).randrange(10) * (n + 1)
    got = Backoff(cap_s=10**12).delay_s(failures, random.Random(seed))
    assert got == float(n**4 + 15 + spread)


@given(failures=FAILURES, seed=SEEDS)
def test_sidekiq_jitter_stays_in_its_band(failures: int, seed: int) -> None:
    n = failures - 1
    got = Backoff(cap_s=10**12).delay_s(failures, random.Random(seed))
    assert n**4 + 15 <= got <= n**4 + 15 + 9 * (n + 1)
    assert (got - n**4 - 15) % (n + 1) == 0


@pytest.mark.parametrize("failures", [1, 2, 7])
def test_sidekiq_jitter_takes_all_ten_steps(failures: int) -> None:
    n = failures - 1
    rng = random.Random(1234)
    seen = {Backoff().delay_s(failures, rng) for _ in range(500)}
    assert seen == {float(n**4 + 15 + k * (n + 1)) for k in range(10)}


@given(failures=FAILURES)
def test_sidekiq_without_an_rng_uses_the_module_random(failures: int) -> None:
    n = failures - 1
    assert n**4 + 15 <= Backoff(cap_s=10**12).delay_s(failures) <= n**4 + 15 + 9 * (n + 1)


@given(failures=FAILURES, seed=SEEDS, cap=CAPS, jitter=st.booleans())
def test_sidekiq_cap_is_respected(failures: int, seed: int, cap: float, jitter: bool) -> None:
    got = Backoff(cap_s=cap, jitter=jitter).delay_s(failures, random.Random(seed))
    assert got <= cap
    assert got == cap or got >= _sidekiq(failures)


@given(failures=FAILURES, base=BASES, cap=CAPS)
def test_exponential_without_jitter_doubles_up_to_the_cap(
    failures: int, base: float, cap: float
) -> None:
    backoff = Backoff(base_s=base, cap_s=cap, jitter=False)
    assert backoff.delay_s(failures) == min(cap, base * 2.0 ** (failures - 1))


@pytest.mark.parametrize(("failures", "expected"), [(1, 2.0), (2, 4.0), (3, 8.0), (6, 60.0)])
def test_exponential_values(failures: int, expected: float) -> None:
    assert Backoff(base_s=2.0, cap_s=60.0, jitter=False).delay_s(failures) == expected


@given(failures=FAILURES, base=BASES, cap=CAPS, seed=SEEDS)
def test_exponential_equal_jitter_is_between_half_and_all_of_the_delay(
    failures: int, base: float, cap: float, seed: int
) -> None:
    delay = min(cap, base * 2.0 ** (failures - 1))
    got = Backoff(base_s=base, cap_s=cap).delay_s(failures, random.Random(seed))
    assert delay / 2 <= got <= delay <= cap


@given(base=BASES, cap=CAPS, sidekiq=st.booleans(), failures=FAILURES)
def test_without_jitter_the_wait_never_shrinks(
    base: float, cap: float, sidekiq: bool, failures: int
) -> None:
    backoff = Backoff(base_s=None if sidekiq else base, cap_s=cap, jitter=False)
    assert backoff.delay_s(failures) <= backoff.delay_s(failures + 1)


@given(
    failures=st.integers(min_value=1, max_value=100_000),
    base=BASES,
    cap=CAPS,
    sidekiq=st.booleans(),
    seed=SEEDS,
)
def test_any_failure_count_gives_a_capped_wait(
    failures: int, base: float, cap: float, sidekiq: bool, seed: int
) -> None:
    """A service restarted with crash-loop backoff may fail without limit: the curve must
    stay defined (and capped) however many failures it has seen."""
    backoff = Backoff(base_s=None if sidekiq else base, cap_s=cap)
    assert 0 < backoff.delay_s(failures, random.Random(seed)) <= cap
