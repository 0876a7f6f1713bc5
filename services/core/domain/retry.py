"""The retry curve: how long a failed task waits before its next attempt."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """A task's retry policy. Without ``base_s`` it is Sidekiq's curve,
    ``n**4 + 15 + rand(10) * (n + 1)`` seconds for the n-th retry (n from 0);
    with it, ``base_s * 2**n`` with equal jitter. Both are capped at ``cap_s``."""

    base_s: float | None = None
    cap_s: float = 86400.0
    jitter: bool = True

    def delay_s(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1 for the first)."""
        n = max(0, failures - 1)
        pick = rng or random
        if self.base_s is None:
            spread = pick.randrange(10) * (n + 1) if self.jitter else 0
            return float(min(self.cap_s, n**4 + 15 + spread))
        # Past 2**1023 a float overflows; the cap has long applied by then.
        delay = min(self.cap_s, self.base_s * 2.0 ** min(n, 1023))
        return delay * (0.5 + pick.random() / 2) if self.jitter else delay


@dataclass(frozen=True)
class ServiceRestarts:
    """How a ``kind: service`` is restarted. Its backoff grows with the restarts since its
    last healthy run (one that lasted ``healthy_s``; Kubernetes resets CrashLoopBackOff
    after ten minutes the same way), and only crashes of the last ``window_s`` count
    towards burying it. A host's death is never counted against the service."""

    healthy_s: float = 600.0
    window_s: float = 3600.0


SERVICE_RESTARTS = ServiceRestarts()
