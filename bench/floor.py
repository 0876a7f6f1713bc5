"""The floor the attempt benchmarks measure Cairn against, in the same run: ``floor.c``,
compiled with the host's ``cc`` into a temp folder, spawns a program N times with only
what a bare isolated spawn needs (fork, a mount namespace with a fresh tmpfs on /tmp,
setgroups/setgid/setuid to an unprivileged uid, a pooled cgroup v1 slot joined once,
exec, wait4) and prints the CPU it used (its own and its reaped children's rusage) and
the wall time; with ``sandbox``, also the rest of the sandbox Cairn's agent and helper
give an attempt (``SANDBOX``), to put the attempts' own processes beside. Used by
bench/attempt_start.py and bench/e2e.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.cgroups import _mounts, _own_paths

SOURCE = Path(__file__).with_name("floor.c")
#: the v1 hierarchies an attempt's pooled slot lives in (as ``services.worker.cgpool``)
HIERARCHIES = ("memory", "cpu", "cpuacct", "pids")
#: an unprivileged uid for the spawned program
NOBODY = 65534
PROGRAMS = {"true": ("/bin/true",), "bash": ("/bin/bash", "-c", "true")}
#: what ``floor -s`` adds to the bare spawn: the rest of an attempt's sandbox (floor.c)
SANDBOX = (
    "+ a process group, a detached tmpfs home attached, the program bound, the home's tmp "
    "bound on /tmp or /var/tmp, a tmpfs /dev/shm, an IPC namespace, RLIMIT_CORE, the uid's "
    "keyrings emptied, no_new_privs"
)
#: where an attempt's tmp is bound, but the one that holds the floor's folder (as
#: ``services.worker.host`` leaves the one that holds the agent's run folder)
TMP_TARGETS = ("/tmp", "/var/tmp")


@dataclass
class Floor:
    """What one or more floor runs measured."""

    spawns: int = 0
    cpu_us: int = 0
    wall_us: int = 0
    #: the spawned children's own CPU (each one's clone to its exec, and the program)
    child_cpu_us: int = 0
    skipped: str = ""
    walls_us: list[int] = field(default_factory=list)

    @property
    def cpu_ms(self) -> float:
        """CPU per spawn: the floor's loop and the program, user + system."""
        return self.cpu_us / 1000 / self.spawns

    @property
    def child_cpu_ms(self) -> float:
        """The children's CPU per spawn: each one's clone to its exec, and the program."""
        return self.child_cpu_us / 1000 / self.spawns

    @property
    def wall_ms(self) -> float:
        """Wall time per spawn: the loops' elapsed time over the spawns."""
        return self.wall_us / 1000 / self.spawns

    @property
    def wall_p50_ms(self) -> float | None:
        """The median spawn's fork-to-reaped time (one loop only)."""
        return statistics.median(self.walls_us) / 1000 if self.walls_us else None

    def add(self, other: Floor) -> None:
        self.spawns += other.spawns
        self.cpu_us += other.cpu_us
        self.wall_us += other.wall_us
        self.child_cpu_us += other.child_cpu_us
        self.skipped = other.skipped
        self.walls_us += other.walls_us


def parse(text: str) -> Floor:
    """The floor's ``key=value`` lines as a ``Floor``."""
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    walls = values.get("walls_us", "")
    return Floor(
        spawns=int(values["spawns"]),
        cpu_us=int(values["cpu_us"]),
        wall_us=int(values["wall_us"]),
        child_cpu_us=int(values.get("child_cpu_us", 0)),
        skipped=values.get("skipped", ""),
        walls_us=[int(w) for w in walls.split(",")] if walls else [],
    )


def ratio(cairn: float, floor: float) -> str:
    """``cairn / floor`` as the benchmarks print it."""
    return f"{cairn / floor:.2f}x" if floor > 0 else "n/a"


def build(folder: Path) -> Path | None:
    """``floor.c`` compiled into ``folder``; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    binary = folder / "floor"
    subprocess.run(
        [compiler, "-O2", "-o", str(binary), str(SOURCE)], check=True, capture_output=True
    )
    return binary


@contextlib.contextmanager
def slot() -> Iterator[list[Path]]:
    """A pooled cgroup v1 slot for the floor (a folder in each hierarchy beside this
    process's own cgroup), its ``cgroup.procs`` files; none without v1 or root."""
    own, mounts = _own_paths(), _mounts()
    folders = []
    if os.geteuid() == 0:
        for name in HIERARCHIES:
            if name in mounts and name in own:
                folder = mounts[name] / own[name].lstrip("/") / f"cairn-floor-{os.getpid()}"
                if folder not in folders:
                    with contextlib.suppress(OSError):
                        folder.mkdir()
                        folders.append(folder)
    try:
        yield [folder / "cgroup.procs" for folder in folders]
    finally:
        for folder in folders:
            with contextlib.suppress(OSError):
                folder.rmdir()


class Runner:
    """The compiled floor and its slot, for the length of a benchmark."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._folder = Path(self._stack.enter_context(tempfile.TemporaryDirectory()))
        self.binary = build(self._folder)
        # ``floor -s``'s folder: the home's mount point and the program's placeholder,
        # reachable by the unprivileged uid
        self._folder.chmod(0o711)
        self._sandbox = self._folder / "sandbox"
        (self._sandbox / "home").mkdir(parents=True)
        (self._sandbox / "program").touch(mode=0o755)
        self._sandbox.chmod(0o711)
        here = self._folder.resolve()
        self._targets = [t for t in TMP_TARGETS if not here.is_relative_to(Path(t).resolve())]
        self.procs = self._stack.enter_context(slot()) if self.binary else []

    def run(
        self, program: Sequence[str], n: int, jobs: int = 1, sandbox: bool = False
    ) -> Floor | None:
        """``n`` spawns of ``program`` over ``jobs`` loops, with the rest of an attempt's
        sandbox too when ``sandbox`` (``SANDBOX``); None without a compiler."""
        if self.binary is None:
            return None
        command = [str(self.binary), "-n", str(n), "-j", str(jobs), "-u", str(NOBODY)]
        for procs in self.procs:
            command += ["-c", str(procs)]
        if sandbox:
            command += ["-s", str(self._sandbox)]
            for target in self._targets:
                command += ["-t", target]
        done = subprocess.run(
            [*command, "--", *program], check=True, capture_output=True, text=True
        )
        return parse(done.stdout)

    def run_both(
        self,
        program: Sequence[str],
        n: int,
        floor: Floor,
        sandboxed: Floor,
        jobs: int = 1,
        sandboxed_first: bool = False,
    ) -> None:
        """``n`` bare spawns of ``program`` added to ``floor`` and as many with the rest of
        an attempt's sandbox to ``sandboxed``, the bare first unless ``sandboxed_first``
        (callers alternate: neither always runs on the other's warm caches)."""
        for sandbox in (True, False) if sandboxed_first else (False, True):
            if (got := self.run(program, n, jobs, sandbox=sandbox)) is not None:
                (sandboxed if sandbox else floor).add(got)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe(floor: Floor, sandbox: bool = False) -> str:
    """What the floor did and did not do, for the benchmark's output."""
    did = "clone (vfork) + mount ns + tmpfs /tmp + uid + pooled cgroup v1 + exec + wait4"
    if sandbox:  # its tmp is the home's, not a tmpfs of its own
        did = f"{did.replace(' + tmpfs /tmp', '')} {SANDBOX}"
    return f"{did}; skipped: {floor.skipped}" if floor.skipped else did
