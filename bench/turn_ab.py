"""Two versions of core's turn side by side: CPU a turn of each, measured over the same minutes.

    .venv/bin/python bench/turn_ab.py --base DIR [--tasks 3000] [--max 1] [--block 100]

``--base`` is another checkout of the code (``git worktree add DIR COMMIT``, or ``git
archive COMMIT | tar -x -C DIR``); this checkout is the other side. Each side gets an
embedded PostgreSQL of its own, migrated by its own code, and core run from its own
tree, with ``--tasks`` no-op tasks submitted. One simulated worker per side turns as
``bench/dispatch.py``'s do (each turn reports what the last one leased, ``succeeded``,
and claims up to ``--max``), in blocks of ``--block`` turns, the sides taking turns,
until both have drained; the first block of each is not counted. Printed: each side's
core and PostgreSQL CPU a turn and a task, and this side's over the base's; and the WAL
each side's server wrote from the end of the submission to the drain, a task (bytes, by
the insert position; records, by ``pg_stat_wal``: every block counted).

Run one after the other, two versions of ``bench/dispatch.py`` meet different minutes of
a shared machine, whose load moves their figures more than a change of a few per cent;
alternated in blocks of a fraction of a second, both meet the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch import submit_all
from fleet import pg_cpu_s
from procstat import cpu_s
from stack import exit_on_sigterm, free_port, start_core

from libs.common.client import CoreClient
from libs.common.embedded import EmbeddedPostgres
from libs.common.models import AttemptReport, ClaimRequest, Turn, WorkerRegister
from libs.common.settings import libpq_url
from services.core import admin

HERE = Path(__file__).resolve().parent.parent
_MIGRATE = (
    "import sys\n"
    "from services.core import migrate as core\n"
    "from services.cron import migrate as cron\n"
    "from services.dag import migrate as dag\n"
    "for m in (core, cron, dag):\n"
    "    m.upgrade(sys.argv[1])\n"
)


class Side:
    """One version: its tree, its database, its core, its worker and what it counted."""

    def __init__(self, name: str, tree: Path) -> None:
        self.name, self.tree = name, tree
        self.root = Path(tempfile.mkdtemp(prefix=f"cairn-bench-turn-ab-{name}-"))
        self.server = EmbeddedPostgres(self.root / "pg")
        self.proc: subprocess.Popen[bytes] | None = None
        self.core = self.pg = self.wall = 0.0
        self.turns = self.tasks = 0
        self.reports: list[AttemptReport] = []
        self.done = self.warm = False
        self.pid = self.postmaster = 0
        self.wal = (0, 0)

    def start(self, tasks: int) -> None:
        url = self.server.start()
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        # ``python -m`` and ``-c`` put the working directory first on the path
        subprocess.run([sys.executable, "-c", _MIGRATE, url], cwd=self.tree, env=env, check=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        here = Path.cwd()
        os.chdir(self.tree)
        try:
            self.proc = start_core(
                url, self.root / "home", port, CAIRN_HEARTBEAT_TIMEOUT_S="600",
                PYTHONPATH=str(self.tree),
            )  # fmt: skip
        finally:
            os.chdir(here)
        self.pid = self.proc.pid
        self.postmaster = int((self.server.data / "postmaster.pid").read_text().split()[0])
        user = admin.create_token(url, "alice", "user")
        asyncio.run(submit_all(self.url, user, tasks))
        self.token = admin.create_token(url, "w0", "worker")
        self.db_url = url
        self.wal = wal(url)

    def wal_since(self) -> tuple[int, int]:
        """WAL bytes and records written since the submission ended."""
        now = wal(self.db_url)
        return now[0] - self.wal[0], now[1] - self.wal[1]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            self.server.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def wal(url: str) -> tuple[int, int]:
    """The server's WAL insert position (bytes) and records written (``pg_stat_wal``,
    after the backends' pending counts are flushed: they report at most once a second)."""
    time.sleep(1.5)
    with psycopg.connect(libpq_url(url)) as db:
        row = db.execute(
            "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn, wal_records FROM pg_stat_wal"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def block(side: Side, core: CoreClient, worker_id: int, room: ClaimRequest, n: int) -> None:
    """``n`` turns of the side's worker; its CPU counted but in its first block."""
    core0, pg0, began = cpu_s(side.pid), pg_cpu_s(side.postmaster), time.perf_counter()
    turns = tasks = 0
    for _ in range(n):
        answer = await core.turn(worker_id, Turn(reports=side.reports, claim=room))
        turns, tasks = turns + 1, tasks + len(answer.reports)
        side.reports = [
            AttemptReport(attempt_id=a.attempt_id, outcome="succeeded", exit_code=0)
            for a in answer.attempts
        ]
        if not answer.attempts:
            side.done = True
            break
    if side.warm:
        side.core += cpu_s(side.pid) - core0
        side.pg += pg_cpu_s(side.postmaster) - pg0
        side.wall += time.perf_counter() - began
        side.turns, side.tasks = side.turns + turns, side.tasks + tasks
    side.warm = True


async def alternate(sides: list[Side], args: argparse.Namespace) -> None:
    room = ClaimRequest(cpu=4000, memory_mb=10_000_000, max=args.max)
    offer = WorkerRegister(hostname="w0", queues=["default"], cpu=4000, memory_mb=10_000_000)
    timeout = httpx.Timeout(60, connect=5)
    async with (
        CoreClient(sides[0].url, sides[0].token, timeout=timeout) as first,
        CoreClient(sides[1].url, sides[1].token, timeout=timeout) as second,
    ):
        clients = [(first, (await first.register_worker(offer)).worker.id)]
        clients.append((second, (await second.register_worker(offer)).worker.id))
        while not all(side.done for side in sides):
            for side, (core, worker_id) in zip(sides, clients, strict=True):
                if not side.done:
                    await block(side, core, worker_id, room, args.block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--max", type=int, default=1)
    parser.add_argument("--block", type=int, default=100)
    args = parser.parse_args()
    exit_on_sigterm()
    sides = [Side("base", args.base.resolve()), Side("this", HERE)]
    try:
        for side in sides:
            side.start(args.tasks)
        load = os.getloadavg()[0]
        asyncio.run(alternate(sides, args))
        written = [side.wal_since() for side in sides]
        print(
            f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}; --tasks {args.tasks} "
            f"--max {args.max} --block {args.block}"
        )
        for s in sides:
            turns, tasks = max(s.turns, 1), max(s.tasks, 1)
            print(
                f"{s.name} ({s.tree}): {s.turns} turns, {s.tasks} tasks, "
                f"{s.turns / max(s.wall, 1e-9):.0f} turns/s; ms of CPU a turn: core "
                f"{s.core * 1e3 / turns:.3f}, PostgreSQL {s.pg * 1e3 / turns:.3f}; a task: "
                f"{(s.core + s.pg) * 1e3 / tasks:.4f}"
            )
        for s, (size, records) in zip(sides, written, strict=True):
            print(
                f"{s.name}: WAL a task {size / args.tasks:.0f} B, "
                f"{records / args.tasks:.1f} records"
            )
        base, this = sides

        def ratio(a: float, b: float) -> str:
            return f"{(a / max(this.turns, 1)) / max(b / max(base.turns, 1), 1e-12):.3f}"

        print(
            f"this / base, CPU a turn: core {ratio(this.core, base.core)}, PostgreSQL "
            f"{ratio(this.pg, base.pg)}, both {ratio(this.core + this.pg, base.core + base.pg)}"
        )
    finally:
        # Both sides stopped whatever happens to one, and a second Ctrl-C or SIGTERM
        # waits until they are (one that came while the first side stopped left the
        # other's core and PostgreSQL running, and both temp folders).
        stopping = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
        try:
            for side in sides:
                try:
                    side.stop()
                except Exception as exc:
                    print(f"{side.name}: not stopped cleanly: {exc!r}", file=sys.stderr)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)


if __name__ == "__main__":
    main()
