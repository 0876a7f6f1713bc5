"""The ``cairn`` command: start the system, run one service, manage tokens."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import CairnSettings

ROLES = ("admin", "service", "user", "worker")


def _database(settings: CairnSettings) -> tuple[str, EmbeddedPostgres | None]:
    """The database URL, and the embedded server if this call started it."""
    if settings.database_url:
        return settings.database_url, None
    server = EmbeddedPostgres(settings.home / "pg")
    was_running = server.running() if (server.data / "PG_VERSION").exists() else False
    url = server.start()
    return url, (None if was_running else server)


def _prepare_home(settings: CairnSettings) -> None:
    settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)


def local_token(settings: CairnSettings, url: str, name: str, role: str) -> str:
    """A token for local use, kept in ``$CAIRN_HOME/NAME-token`` (mode 0600) and reused."""
    from services.core import admin

    path = settings.home / f"{name}-token"
    if path.exists():
        token = path.read_text().strip()
        principal = admin.principal_for(url, token)
        if principal is not None and principal.role == role:
            return token
    token = admin.create_token(url, name, role)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def cmd_migrate(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.core import migrate

    _prepare_home(settings)
    url, started = _database(settings)
    try:
        migrate.upgrade(url)
    finally:
        if started is not None:
            started.stop()
    print("core schema is at the newest migration")
    return 0


def cmd_token_create(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.core import admin, migrate

    _prepare_home(settings)
    url, started = _database(settings)
    try:
        migrate.upgrade(url)
        token = admin.create_token(url, args.name, args.role)
    except ValueError as exc:
        print(f"cairn: {exc}", file=sys.stderr)
        return 2
    finally:
        if started is not None:
            started.stop()
    print(token)
    return 0


def cmd_worker(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.core.worker.agent import main

    main()
    return 0


def cmd_core(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.core.__main__ import main

    main(args.rest)
    return 0


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """Stop the processes by pid, the last started first (workers hand back through core)."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cmd_up(settings: CairnSettings, args: argparse.Namespace) -> int:
    """Start the database (embedded unless a URL is set), core, and wait for Ctrl-C."""
    from services.core import migrate

    _prepare_home(settings)
    url, started = _database(settings)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        migrate.upgrade(url)
        token = local_token(settings, url, "admin", "admin")
        worker_token = local_token(settings, url, "local-worker", "worker")
        env = {**os.environ, "CAIRN_DATABASE_URL": url, "CAIRN_MIGRATE_ON_START": "false"}
        core_url = f"http://{settings.bind_host}:{settings.core_port}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.core"], env=env, start_new_session=True
            )
        )
        _wait_ready(core_url, procs[0])
        worker_env = {
            **env,
            "CAIRN_URL": core_url,
            "CAIRN_TOKEN": worker_token,
            "CAIRN_WORKER_DRAIN_GRACE_S": os.environ.get("CAIRN_WORKER_DRAIN_GRACE_S", "5"),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.core.worker"],
                env=worker_env,
                start_new_session=True,
            )
        )
        print(
            f"\ncairn is up\n  core      {core_url}  (OpenAPI at {core_url}/docs)\n"
            f"  worker    queues {settings.worker_queues}, {settings.worker_cpu:g} CPU, "
            f"{settings.worker_memory_mb} MB\n"
            f"  database  {'embedded, ' + str(settings.home / 'pg') if started else 'as configured'}\n"
            f"  token     {token}  (admin; also in {settings.home / 'admin-token'})\n"
            "Ctrl-C stops everything.\n",
            flush=True,
        )
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"cairn: a service exited with status {dead[0].returncode}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except RuntimeError as exc:
        print(f"cairn: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(procs)
        if started is not None:
            started.stop()
        print("cairn stopped", flush=True)


def _get(settings: CairnSettings, path: str, **params: str) -> object:
    """GET a JSON document from core as ``CAIRN_TOKEN``; exits with core's problem."""
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    answer = httpx.get(
        settings.url + path, params=params, headers=headers, timeout=httpx.Timeout(10, connect=3)
    )
    if not answer.is_success:
        detail = answer.json().get("detail") if answer.content else answer.reason_phrase
        sys.exit(f"cairn: {answer.status_code} {detail}")
    return answer.json()


def cmd_why(settings: CairnSettings, args: argparse.Namespace) -> int:
    """Why isn't my task running?"""
    task = _get(settings, f"/v1/tasks/{args.task_id}")
    assert isinstance(task, dict)
    reason = task.get("pending_reason") or (
        "it is running" if task["state"] == "running" else f"it is {task['state']}"
    )
    print(f"task {task['id']} ({task['name']}) is {task['state']}: {reason}")
    return 0


def cmd_rightsize(settings: CairnSettings, args: argparse.Namespace) -> int:
    """Requested against measured use, per owner and task name, with a suggestion."""
    params = {k: v for k, v in (("owner", args.owner), ("name", args.name)) if v}
    report = _get(settings, "/v1/usage", **params)
    assert isinstance(report, dict)
    print(
        f"{'owner':<16} {'name':<24} {'runs':>5} {'cpu req/p95/suggest':>22}"
        f" {'memory MB req/p95/suggest':>28}"
    )
    for r in report["items"]:
        cpu = f"{r['requested_cpu']:g}/{r['p95_cpu']:.2f}/{r['suggested_cpu']:g}"
        memory = (
            f"{r['requested_memory_mb']:.0f}/{r['p95_memory_mb']:.0f}/{r['suggested_memory_mb']}"
        )
        print(f"{r['owner']:<16} {r['name']:<24} {r['attempts']:>5} {cpu:>22} {memory:>28}")
    return 0


def cmd_trace(settings: CairnSettings, args: argparse.Namespace) -> int:
    from cairn.trace import Shape, write

    shape = Shape(
        users=args.users, tasks_per_user=args.tasks_per_user, hours=args.hours, seed=args.seed
    )
    count = write(args.out, shape)
    print(f"{count} submissions written to {args.out}")
    return 0


def cmd_sim(settings: CairnSettings, args: argparse.Namespace) -> int:
    from cairn.sim import Policy, render, simulate
    from cairn.trace import read

    meta, submissions = read(args.trace)
    if args.workers:
        meta["cluster"]["workers"] = args.workers
    policy = Policy(
        measured=not args.declared, overcommit=args.overcommit, defer_above=args.defer_above
    )
    print(render(meta, policy, simulate(meta, submissions, policy)))
    return 0


def _add_placement_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    why = sub.add_parser("why", help="say why a task is not running (CAIRN_URL, CAIRN_TOKEN)")
    why.add_argument("task_id", type=int)
    why.set_defaults(func=cmd_why)
    size = sub.add_parser("rightsize", help="requested against measured use, with suggestions")
    size.add_argument("--owner")
    size.add_argument("--name")
    size.set_defaults(func=cmd_rightsize)
    trace = sub.add_parser("trace", help="write a workload trace from the design's figures")
    trace.add_argument("out", type=Path)
    trace.add_argument("--users", type=int, default=10_000)
    trace.add_argument("--tasks-per-user", type=float, default=100.0)
    trace.add_argument("--hours", type=float, default=24.0)
    trace.add_argument("--seed", type=int, default=7)
    trace.set_defaults(func=cmd_trace)
    sim = sub.add_parser("sim", help="replay a trace through core's placement, simulated")
    sim.add_argument("trace", type=Path)
    sim.add_argument("--declared", action="store_true", help="place everything on requests")
    sim.add_argument("--overcommit", type=float, default=1.0)
    sim.add_argument("--defer-above", type=float, default=1.0)
    sim.add_argument("--workers", type=int, help="override the trace's cluster size")
    sim.set_defaults(func=cmd_sim)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cairn", description="Cairn task scheduling")
    parser.add_argument("--home", type=Path, help="data directory (CAIRN_HOME)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the whole system on loopback").set_defaults(func=cmd_up)
    core = sub.add_parser("core", help="run core's API and loops", add_help=False)
    core.add_argument("rest", nargs=argparse.REMAINDER)
    core.set_defaults(func=cmd_core)
    sub.add_parser("migrate", help="migrate core's schema").set_defaults(func=cmd_migrate)
    sub.add_parser(
        "worker", help="run a worker agent (CAIRN_URL, CAIRN_TOKEN of a worker principal)"
    ).set_defaults(func=cmd_worker)
    token = sub.add_parser("token", help="manage bearer tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="create a principal's token and print it")
    create.add_argument("name")
    create.add_argument("--role", choices=ROLES, default="user")
    create.set_defaults(func=cmd_token_create)
    _add_placement_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    overrides = {"home": args.home} if args.home else {}
    settings = CairnSettings(**overrides)
    sys.exit(args.func(settings, args))
