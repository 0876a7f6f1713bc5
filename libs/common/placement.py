"""What core's placement and the worker agents agree on."""

from __future__ import annotations

#: the CPU a squeezed attempt still counts for, as a share of its charge (nice 19 against
#: nice 0 is a weight of 15 to 1024; cgroup ``cpu.weight`` 1 against 100 is less still)
SQUEEZED_CPU_SHARE = 0.05
