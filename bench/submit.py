"""Submit benchmark: core's ``POST /v1/tasks`` against a bare FastAPI + psycopg INSERT
endpoint in the same run, and ``POST /v1/tasks/batch`` on its own.

    .venv/bin/python bench/submit.py [--duration 10] [--concurrency 32] [--batch-size 1000]
                                     [--rounds 3] [--core-workers 1] [--open-rate 300]
                                     [--port-base 22000] [--json results.json]

One run starts a fresh embedded PostgreSQL (durable settings unless ``--fast``) in a temp
folder, migrates it, creates a token, and starts two servers as their own processes, each
one uvicorn process with uvloop and httptools (core: ``--core-workers`` of them): core
(``python -m services.core``) and the bare app (``bench/bare_app.py``: its own table in the same database). A load generator,
a separate process speaking raw HTTP/1.1 over keep-alive connections, drives one target
at a time for a warm-up and then a fixed measured window. Single-submit rounds alternate
bare and cairn (bare first in even rounds, cairn first in odd ones) and the medians are
reported. The servers, PostgreSQL and the load generator share the machine's cores, so the
CPU each used per 1000 tasks is shown too, with the machine's total load and the share of
it that was not this benchmark. At the end the rows in each table are counted against the
201 answers received. With ``--open-rate R``, rounds of single submissions open loop at R
a second (on up to ``--open-connections``) follow, bare and cairn alternating, and the
server + PostgreSQL CPU per submission of each and their ratio are printed. Bars
(DESIGN.md, issue 35): cairn/bare >= 0.9 closed loop; cairn/bare CPU per submission
<= 1.25 open loop; batch >= 30,000 tasks/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from procstat import TICK, children, machine_ticks, stat_fields
from rawhttp import Conn, request_bytes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NPROC = os.cpu_count() or 1

SINGLE_BAR = 0.9
OPEN_BAR = 1.25
BATCH_BAR = 30_000


# --- the load generator (its own process: ``submit.py --loadgen CONFIG``) ----------------


class _Load:
    """Closed-loop load: each connection sends the next request when the last one answers;
    or, with ``rate``, open loop: a request every 1/rate s on the next free connection
    (``late`` counts sends that found every connection busy and waited). Requests sent
    and answered inside the measured window are counted and timed."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        body = Path(cfg["body_file"]).read_bytes()
        self.data = request_bytes(cfg["host"], cfg["port"], cfg["path"], body, cfg.get("token"))
        self.latencies: list[float] = []
        self.ok = 0
        self.errors = 0
        self.statuses: dict[str, int] = {}
        self.samples: list[str] = []
        self.marks: dict[str, float] = {}
        self.t0 = self.t1 = 0.0
        self.answered = 0  # answers (any status) that arrived inside the window
        self.late = 0

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        conns = []
        for _ in range(self.cfg["concurrency"]):
            _, proto = await loop.create_connection(
                lambda: Conn(loop), self.cfg["host"], self.cfg["port"]
            )
            conns.append(proto)
        self.t0 = time.perf_counter() + self.cfg["warmup"]
        self.t1 = self.t0 + self.cfg["duration"]
        marks = [
            asyncio.ensure_future(self._mark(n, t))
            for n, t in (("start", self.t0), ("end", self.t1))
        ]
        if self.cfg.get("rate"):
            await self._open_loop(conns)
        else:
            await asyncio.gather(*(self._worker(c) for c in conns))
        await asyncio.gather(*marks)
        for conn in conns:
            conn.transport.close()
        return self._result()

    async def _mark(self, name: str, at: float) -> None:
        """Tell the parent (on stdout) when the window opens and closes, to meter CPU."""
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        self.marks[name + "_cpu"] = time.process_time()
        self.marks[name] = time.perf_counter()
        print(f"MARK {name}", flush=True)

    async def _worker(self, conn: Conn) -> None:
        while time.perf_counter() < self.t1:
            if not await self._one(conn):
                return

    async def _one(self, conn: Conn) -> bool:
        """One request on ``conn``, counted; False if the connection failed."""
        sent = time.perf_counter()
        try:
            status, answer = await conn.request(self.data, self.cfg["timeout"])
        except (OSError, TimeoutError, ConnectionError) as exc:
            self.errors += 1
            self.samples.append(repr(exc))
            return False
        done = time.perf_counter()
        if self.t0 <= done <= self.t1:
            self.answered += 1
        if status != self.cfg["expect"]:
            self.errors += 1
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            if len(self.samples) < 3:
                self.samples.append(answer[:300].decode(errors="replace"))
            return True
        self.ok += 1
        if self.t0 <= sent and done <= self.t1:
            self.latencies.append(done - sent)
        return True

    async def _open_loop(self, conns: list[Conn]) -> None:
        free: asyncio.Queue[Conn] = asyncio.Queue()
        for conn in conns:
            free.put_nowait(conn)
        interval = 1.0 / self.cfg["rate"]
        start = time.perf_counter()
        running: set[asyncio.Future[None]] = set()

        async def send(conn: Conn) -> None:
            if await self._one(conn):
                free.put_nowait(conn)

        n = 0
        while (due := start + n * interval) < self.t1:
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            if free.empty():
                self.late += 1
            job = asyncio.ensure_future(send(await free.get()))
            running.add(job)
            job.add_done_callback(running.discard)
            n += 1
        await asyncio.gather(*running)

    def _result(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else None

        window = self.marks["end"] - self.marks["start"]
        per = self.cfg["tasks_per_request"]
        return {
            "requests": len(lat),
            "tasks_per_request": per,
            "window_s": window,
            "requests_per_s": len(lat) / window,
            "answered": self.answered,
            "late": self.late,
            "tasks_per_s": len(lat) * per / window,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "ok_total": self.ok,
            "errors": self.errors,
            "error_statuses": self.statuses,
            "error_samples": self.samples[:3],
            "loadgen_cpu_s": self.marks["end_cpu"] - self.marks["start_cpu"],
        }


def loadgen_main(config_path: str) -> None:
    import uvloop

    cfg = json.loads(Path(config_path).read_text())
    result = uvloop.run(_Load(cfg).run())
    print("RESULT " + json.dumps(result), flush=True)


# --- CPU accounting -----------------------------------------------------------------------


def _cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime: the postmaster's reaped children count too, so
    backends that exit within the window (pool churn) are not lost."""
    fields = stat_fields(pid)
    return sum(int(f) for f in fields[11:15]) if fields else 0


class CpuMeter:
    """CPU seconds used by groups of processes between ``start`` and ``stop``, the machine's
    busy fraction, and how far PostgreSQL's counters (``counters``: sessions opened, WAL
    written, checkpoints) moved meanwhile."""

    def __init__(
        self,
        groups: dict[str, Callable[[], list[int]]],
        counters: Callable[[], dict[str, int]],
    ) -> None:
        self.groups = groups
        self.counters = counters
        self.before: dict[str, dict[int, int]] = {}
        self.machine_before = (0, 0)
        self.counters_before: dict[str, int] = {}

    def _snap(self) -> dict[str, dict[int, int]]:
        return {
            name: {pid: _cpu_ticks(pid) for pid in pids()} for name, pids in self.groups.items()
        }

    def start(self) -> None:
        self.before = self._snap()
        self.machine_before = machine_ticks()
        self.counters_before = self.counters()

    def stop(self) -> dict[str, Any]:
        after = self._snap()
        busy1, total1 = machine_ticks()
        busy0, total0 = self.machine_before
        cpu = {
            name: sum(t - self.before.get(name, {}).get(pid, 0) for pid, t in now.items()) / TICK
            for name, now in after.items()
        }
        # PostgreSQL's counters lag by up to a second; a window of seconds absorbs it.
        moved = {k: v - self.counters_before.get(k, 0) for k, v in self.counters().items()}
        return {
            "cpu_s": cpu,
            "machine_busy": (busy1 - busy0) / max(1, total1 - total0),
            "pg_sessions_opened": moved.pop("sessions"),
            "pg": moved,
        }


def _background_cores(seconds: float = 2.0) -> float:
    busy0, total0 = machine_ticks()
    time.sleep(seconds)
    busy1, total1 = machine_ticks()
    return (busy1 - busy0) / max(1, total1 - total0) * NPROC


# --- processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Stopped(Exception):
    pass


def _on_signal(signum: int, frame: Any) -> None:
    raise Stopped(f"signal {signum}")


def _stop(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM by pid, then SIGKILL if it has not exited within 20 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _wait_ready(proc: subprocess.Popen[Any], url: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: not ready within {timeout} s")


def _task_spec() -> dict[str, Any]:
    """One submission, the same for both endpoints: a little of everything, no key."""
    sha = hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest()
    return {
        "name": "bench-task",
        "artifact": {"uri": "file:///bin/true", "sha256": sha},
        "args": ["--items", "10", "--mode", "fast"],
        "env": {"BENCH": "1", "LEVEL": "info"},
        "labels": {"team": "bench", "run": "submit"},
    }


def _machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": NPROC,
        "cpu_model": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


# --- the run ------------------------------------------------------------------------------


class Bench:
    """One run: a database, two servers, the rounds, the check; ``close`` undoes it all."""

    def __init__(self, args: argparse.Namespace) -> None:
        from libs.common.embedded import EmbeddedPostgres

        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="cairn-bench-"))
        self.pg = EmbeddedPostgres(self.work / "pg", fast=args.fast)
        self.core: subprocess.Popen[bytes] | None = None
        self.bare: subprocess.Popen[bytes] | None = None
        self.stats: Any = None
        self.runs: dict[str, list[dict[str, Any]]] = {
            name: [] for name in ("bare", "cairn", "batch", "open_bare", "open_cairn")
        }
        self.info: dict[str, Any] = {}

    def setup(self) -> None:
        import bare_app
        import psycopg

        from libs.common.settings import libpq_url
        from services.core import admin, migrate

        if self.args.port_base:  # the embedded server takes the port its folder names
            (self.work / "pg").mkdir(mode=0o700)
            (self.work / "pg" / "port").write_text(str(self.args.port_base + 2))
        url = self.pg.start()
        self.url, self.libpq = url, libpq_url(url)
        migrate.upgrade(url)
        ddl = (
            bare_app.CREATE_TABLE
            if self.args.bare_table == "plain"
            else bare_app.CREATE_TABLE_LIKE_CORE
        )
        with psycopg.connect(self.libpq, autocommit=True) as conn:
            conn.execute(ddl)
            self.info["postgres"] = {
                key: conn.execute(f"SHOW {key}").fetchone()[0]  # type: ignore[index]
                for key in ("server_version", "fsync", "synchronous_commit", "full_page_writes")
            }
        self.token = admin.create_token(url, "bench", "user")
        if self.args.port_base:
            self.core_port, self.bare_port = self.args.port_base, self.args.port_base + 1
        else:
            self.core_port, self.bare_port = _free_port(), _free_port()
        self.core = subprocess.Popen(
            [sys.executable, "-m", "services.core"],
            cwd=ROOT,
            env={
                **os.environ,
                "CAIRN_DATABASE_URL": url,
                "CAIRN_CORE_PORT": str(self.core_port),
                "CAIRN_MIGRATE_ON_START": "false",
                "CAIRN_HOME": str(self.work / "home"),
                "CAIRN_LOG_LEVEL": "warning",
                "CAIRN_CORE_WORKERS": str(self.args.core_workers),
            },
        )
        self.bare = subprocess.Popen(
            [sys.executable, str(HERE / "bare_app.py")],
            cwd=ROOT,
            env={
                **os.environ,
                "BARE_DATABASE_URL": self.libpq,
                "BARE_PORT": str(self.bare_port),
                "BARE_POOL_MIN": "10",
                "BARE_POOL_MAX": "20",
            },
        )
        _wait_ready(self.core, f"http://127.0.0.1:{self.core_port}")
        _wait_ready(self.bare, f"http://127.0.0.1:{self.bare_port}")
        spec = _task_spec()
        self.single_body = self.work / "single.json"
        self.single_body.write_text(json.dumps(spec))
        self.batch_body = self.work / "batch.json"
        self.batch_body.write_text(json.dumps({"tasks": [spec] * self.args.batch_size}))
        self.stats = psycopg.connect(self.libpq, autocommit=True)

    def _counters(self) -> dict[str, int]:
        """Sessions opened, WAL written (bytes, full-page images) and checkpoints done."""
        self.stats.execute("SELECT pg_stat_force_next_flush()")
        row = self.stats.execute(
            "SELECT (SELECT sessions FROM pg_stat_database WHERE datname = current_database()),"
            " w.wal_bytes, w.wal_fpi, c.num_done"
            " FROM pg_stat_wal w, pg_stat_checkpointer c"
        ).fetchone()
        assert row is not None
        keys = ("sessions", "wal_bytes", "wal_fpi", "checkpoints")
        return {k: int(v or 0) for k, v in zip(keys, row, strict=True)}

    def _postgres_pids(self) -> list[int]:
        pid = self.pg.pid()
        return [pid, *children(pid)] if pid else []

    def load(
        self, name: str, server: subprocess.Popen[bytes], cfg: dict[str, Any]
    ) -> dict[str, Any]:
        """Run the load generator once against one server; meter CPU over its window."""
        cfg = {
            "host": "127.0.0.1",
            "warmup": self.args.warmup,
            "duration": self.args.duration,
            "timeout": 30.0,
            "expect": 201,
            **cfg,
        }
        cfg_path = self.work / f"load-{name}.json"
        cfg_path.write_text(json.dumps(cfg))
        meter = CpuMeter(
            {
                "server": lambda: [server.pid, *children(server.pid)],
                "postgres": self._postgres_pids,
            },
            self._counters,
        )
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--loadgen", str(cfg_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + self.args.warmup + self.args.duration + 90
        result: dict[str, Any] | None = None
        metered: dict[str, Any] = {}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("MARK start"):
                    meter.start()
                elif line.startswith("MARK end"):
                    metered = meter.stop()
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            _stop(proc)
        if result is None or proc.returncode != 0 or not metered:
            raise RuntimeError(f"load generator failed ({proc.returncode})")
        result.update(metered, name=name, concurrency=cfg["concurrency"])
        result["cpu_s"]["loadgen"] = result.pop("loadgen_cpu_s")
        ours = sum(result["cpu_s"].values()) / result["window_s"]
        result["other_cores"] = max(0.0, result["machine_busy"] * NPROC - ours)
        return result

    def single_rounds(self, rate: float = 0.0) -> None:
        """Rounds of bare and cairn, alternating which goes first: closed loop on
        ``--concurrency`` connections, or open loop at ``rate`` a second."""
        targets = {
            "bare": (self.bare, self.bare_port, None),
            "cairn": (self.core, self.core_port, self.token),
        }
        for rnd in range(self.args.rounds):
            for name in ("bare", "cairn") if rnd % 2 == 0 else ("cairn", "bare"):
                server, port, token = targets[name]
                assert server is not None
                cfg = {
                    "port": port,
                    "path": "/v1/tasks",
                    "body_file": str(self.single_body),
                    "token": token,
                    "concurrency": self.args.open_connections if rate else self.args.concurrency,
                    "tasks_per_request": 1,
                    "rate": rate,
                }
                key = f"open_{name}" if rate else name
                r = self.load(f"{key}-{rnd}", server, cfg)
                self.runs[key].append(r)
                _progress(rnd, key, r)

    def batch_rounds(self) -> None:
        assert self.core is not None
        for rnd in range(self.args.rounds):
            cfg = {
                "port": self.core_port,
                "path": "/v1/tasks/batch",
                "body_file": str(self.batch_body),
                "token": self.token,
                "concurrency": self.args.batch_concurrency,
                "tasks_per_request": self.args.batch_size,
            }
            r = self.load(f"batch-{rnd}", self.core, cfg)
            self.runs["batch"].append(r)
            _progress(rnd, "batch", r)

    def check(self) -> dict[str, Any]:
        """Every 201 must be a row, and every row a 201."""
        count = "SELECT count(*) FROM {}"
        bare_rows = self.stats.execute(count.format("public.bare_tasks")).fetchone()[0]
        core_rows = self.stats.execute(count.format("core.tasks")).fetchone()[0]
        runs = self.runs
        bare_ok = sum(r["ok_total"] for r in runs["bare"] + runs["open_bare"])
        core_ok = sum(r["ok_total"] for r in runs["cairn"] + runs["open_cairn"])
        core_ok += self.args.batch_size * sum(r["ok_total"] for r in runs["batch"])
        return {
            "bare_rows": bare_rows,
            "bare_201": bare_ok,
            "core_rows": core_rows,
            "core_201_tasks": core_ok,
            "consistent": bare_rows == bare_ok and core_rows == core_ok,
        }

    def close(self) -> None:
        if self.stats is not None:
            with contextlib.suppress(Exception):
                self.stats.close()
        _stop(self.core)
        _stop(self.bare)
        with contextlib.suppress(Exception):
            self.pg.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def _progress(rnd: int, name: str, r: dict[str, Any]) -> None:
    tasks = max(1, r["requests"] * r["tasks_per_request"])
    pg = r["pg"]
    print(
        f"  round {rnd + 1} {name:10s}: {r['tasks_per_s']:8.0f} tasks/s"
        f"  p50 {r['p50_ms']:.2f} ms"
        f"  p99 {r['p99_ms']:.2f} ms  errors {r['errors']}  "
        f"(other load {r['other_cores']:.2f} cores); WAL {pg['wal_bytes'] / tasks:.0f} B"
        f" and {pg['wal_fpi'] / tasks:.2f} page images a task, {pg['checkpoints']} checkpoints",
        flush=True,
    )


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds; CPU as milliseconds per 1000 tasks, over the summed runs."""

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    tasks = sum(r["requests"] * r["tasks_per_request"] for r in runs)
    window = sum(r["window_s"] for r in runs)
    cpu: dict[str, float] = {}
    for r in runs:
        for k, v in r["cpu_s"].items():
            cpu[k] = cpu.get(k, 0.0) + v
    return {
        "tasks_per_s": median("tasks_per_s"),
        "requests_per_s": median("requests_per_s"),
        "p50_ms": median("p50_ms"),
        "p99_ms": median("p99_ms"),
        "rounds_tasks_per_s": [round(r["tasks_per_s"], 1) for r in runs],
        "errors": sum(r["errors"] for r in runs),
        "cpu_ms_per_1000_tasks": {k: 1e6 * v / tasks for k, v in cpu.items()} if tasks else {},
        "machine_busy": median("machine_busy"),
        "other_cores": median("other_cores"),
        "pg_sessions_opened_per_s": sum(r["pg_sessions_opened"] for r in runs) / window,
    }


def _results(bench: Bench, started: dt.datetime, background: float) -> dict[str, Any]:
    args, runs = bench.args, bench.runs
    res: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "background_cores_before": background,
        "postgres": {"embedded": True, "fast": args.fast, **bench.info["postgres"]},
        "settings": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "batch_size": args.batch_size,
            "batch_concurrency": args.batch_concurrency,
            "bare_table": args.bare_table,
            "core_workers": args.core_workers,
            "open_rate": args.open_rate,
            "open_connections": args.open_connections,
            "core_pool": "core's defaults: SQLAlchemy pool_size 10, max_overflow 10",
            "bare_pool": "psycopg_pool min_size 10, max_size 20",
        },
        "check": bench.check(),
        "runs": runs,
    }
    if runs["bare"] and runs["cairn"]:
        res["bare"], res["cairn"] = _summary(runs["bare"]), _summary(runs["cairn"])
        res["ratio"] = res["cairn"]["tasks_per_s"] / res["bare"]["tasks_per_s"]
        res["ratio_rounds"] = [
            c["tasks_per_s"] / b["tasks_per_s"]
            for b, c in zip(runs["bare"], runs["cairn"], strict=True)
        ]
    if runs["batch"]:
        res["batch"] = _summary(runs["batch"])
    if runs["open_bare"] and runs["open_cairn"]:
        res["open"] = _open_summary(args.open_rate, runs["open_bare"], runs["open_cairn"])
    return res


def _cpu_per_answer(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Milliseconds of CPU per answer inside the window, by process group, over rounds."""
    answered = sum(r["answered"] for r in runs) or 1
    return {k: 1000 * sum(r["cpu_s"][k] for r in runs) / answered for k in ("server", "postgres")}


def _open_summary(
    rate: float, bare: list[dict[str, Any]], cairn: list[dict[str, Any]]
) -> dict[str, Any]:
    """The open-loop bar: server + PostgreSQL CPU per submission, cairn over bare, over
    all rounds and round by round."""

    def both(runs: list[dict[str, Any]]) -> float:
        return sum(_cpu_per_answer(runs).values())

    return {
        "rate": rate,
        "bare": {**_summary(bare), "cpu_ms_per_submission": _cpu_per_answer(bare)},
        "cairn": {**_summary(cairn), "cpu_ms_per_submission": _cpu_per_answer(cairn)},
        "sent_late": {"bare": sum(r["late"] for r in bare), "cairn": sum(r["late"] for r in cairn)},
        "ratio": both(cairn) / both(bare),
        "ratio_rounds": [both([c]) / both([b]) for b, c in zip(bare, cairn, strict=True)],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before (2)")
    p.add_argument("--concurrency", type=int, default=32, help="connections, single submit (32)")
    p.add_argument("--batch-size", type=int, default=1000, help="tasks per batch request (1000)")
    p.add_argument("--batch-concurrency", type=int, default=4, help="connections, batch (4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of bare+cairn, and of batch (3)")
    p.add_argument(
        "--bare-table",
        choices=("plain", "like-core"),
        default="plain",
        help="bare table: core's columns + a primary key (plain), or LIKE core.tasks "
        "INCLUDING ALL: every index and check of core's table (like-core)",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="PostgreSQL with fsync, synchronous_commit, full_page_writes off",
    )
    p.add_argument(
        "--core-workers",
        type=int,
        default=1,
        help="core's uvicorn worker processes (CAIRN_CORE_WORKERS; the bare app keeps one) (1)",
    )
    p.add_argument(
        "--open-rate",
        type=float,
        default=0.0,
        help="also rounds of single submissions open loop at this rate a second, bare and "
        "cairn: server + PostgreSQL CPU per submission and their ratio (off: 0)",
    )
    p.add_argument("--open-connections", type=int, default=64, help="connections, open loop (64)")
    p.add_argument(
        "--port-base",
        type=int,
        default=0,
        help="core on this port, bare on the next, PostgreSQL on the one after (0: free ports)",
    )
    p.add_argument("--skip-single", action="store_true", help="no closed-loop single rounds")
    p.add_argument("--skip-batch", action="store_true", help="only the single-submit rounds")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    p.add_argument("--loadgen", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.loadgen:
        loadgen_main(args.loadgen)
        return
    sys.path.insert(0, str(HERE))
    signal.signal(signal.SIGTERM, _on_signal)
    started = dt.datetime.now(dt.UTC)
    background = _background_cores()
    print(
        f"other load before start: {background:.2f} cores busy"
        + (
            "  (WARNING: the machine is not idle; figures will be low and noisy)"
            if background > 0.2
            else ""
        ),
        flush=True,
    )
    print("PostgreSQL: embedded, " + ("FAST: fsync off" if args.fast else "durable: fsync on"))
    bench = Bench(args)
    try:
        bench.setup()
        if not args.skip_single:
            bench.single_rounds()
        if args.open_rate:
            bench.single_rounds(args.open_rate)
        if not args.skip_batch:
            bench.batch_rounds()
        res = _results(bench, started, background)
        report(res)
        if args.json:
            args.json.write_text(json.dumps(res, indent=2) + "\n")
            print(f"results written to {args.json}")
    except (Stopped, KeyboardInterrupt) as exc:
        print(f"stopped ({exc!r}); cleaning up", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.close()


# --- the report ---------------------------------------------------------------------------

ROWS = (
    ("bare FastAPI+psycopg", "bare"),
    ("cairn POST /v1/tasks", "cairn"),
    ("cairn batch", "batch"),
)


def report(res: dict[str, Any]) -> None:
    m, s, pgc = res["machine"], res["settings"], res["postgres"]
    print(f"\nSubmit benchmark, {res['started']}")
    print(
        f"machine: {m['nproc']} cores, {m['cpu_model']}; Python {m['python']}; PostgreSQL "
        f"{pgc['server_version']} embedded, fsync={pgc['fsync']} "
        f"synchronous_commit={pgc['synchronous_commit']}"
    )
    print(
        f"load: {s['concurrency']} connections (batch: {s['batch_concurrency']} x "
        f"{s['batch_size']} tasks), {s['warmup_s']:g} s warm-up + {s['duration_s']:g} s "
        f"measured, {s['rounds']} rounds, medians; bare table: {s['bare_table']}; "
        f"core workers: {s['core_workers']}"
    )
    print(
        "the load generator, both servers and PostgreSQL share these cores; other load "
        f"before start: {res['background_cores_before']:.2f} cores\n"
    )
    head = f"{'target':<22}{'tasks/s':>9}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'errors':>7}  per round"
    print(head + "\n" + "-" * len(head))
    for label, key in ROWS:
        if (r := res.get(key)) is not None:
            print(
                f"{label:<22}{r['tasks_per_s']:>9.0f}{r['requests_per_s']:>8.0f}"
                f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['errors']:>7}  "
                + ", ".join(f"{x:.0f}" for x in r["rounds_tasks_per_s"])
            )
    head = (
        f"{'CPU ms / 1000 tasks':<22}{'server':>8}{'postgres':>10}{'loadgen':>9}"
        f"{'machine busy':>14}{'other load':>13}{'PG sessions/s':>15}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for label, key in ROWS:
        if (r := res.get(key)) is not None:
            cpu = r["cpu_ms_per_1000_tasks"]
            print(
                f"{label:<22}{cpu['server']:>8.0f}{cpu['postgres']:>10.0f}{cpu['loadgen']:>9.0f}"
                f"{100 * r['machine_busy']:>13.0f}%{r['other_cores']:>8.2f} cores"
                f"{r['pg_sessions_opened_per_s']:>15.1f}"
            )
    print()
    if "ratio" in res:
        verdict = "meets" if res["ratio"] >= SINGLE_BAR else "MISSES"
        rounds = ", ".join(f"{x:.3f}" for x in res["ratio_rounds"])
        print(
            f"single submit, cairn/bare: {res['ratio']:.3f} (per round: {rounds}) -> "
            f"{verdict} the bar >= {SINGLE_BAR}"
        )
    if "open" in res:
        _report_open(res["open"])
    if "batch" in res:
        rate = res["batch"]["tasks_per_s"]
        verdict = "meets" if rate >= BATCH_BAR else "MISSES"
        print(f"batch submit: {rate:.0f} tasks/s -> {verdict} the bar >= {BATCH_BAR:,}")
    c = res["check"]
    print(
        f"check: bare rows {c['bare_rows']} = 201s {c['bare_201']}; core rows "
        f"{c['core_rows']} = tasks answered 201 {c['core_201_tasks']}: "
        + ("ok" if c["consistent"] else "MISMATCH")
    )


def _report_open(o: dict[str, Any]) -> None:
    print(f"open loop at {o['rate']:g} submissions/s (sends that found every connection busy:")
    print(f"  bare {o['sent_late']['bare']}, cairn {o['sent_late']['cairn']})")
    for name in ("bare", "cairn"):
        r = o[name]
        cpu = r["cpu_ms_per_submission"]
        print(
            f"  {name:5s}: {r['tasks_per_s']:6.0f} tasks/s answered, p50 {r['p50_ms']:.2f} ms; "
            f"CPU a submission: server {cpu['server']:.3f} + PostgreSQL {cpu['postgres']:.3f}"
            f" = {cpu['server'] + cpu['postgres']:.3f} ms"
        )
    verdict = "meets" if o["ratio"] <= OPEN_BAR else "MISSES"
    rounds = ", ".join(f"{x:.3f}" for x in o["ratio_rounds"])
    print(
        f"open-loop CPU a submission, cairn/bare: {o['ratio']:.3f} (per round: {rounds}) -> "
        f"{verdict} the bar <= {OPEN_BAR}"
    )


if __name__ == "__main__":
    main()
