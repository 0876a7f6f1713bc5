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


def migrate_all(url: str) -> None:
    """Every service's schema, to its newest migration."""
    from services.core import migrate as core_migrate
    from services.cron import migrate as cron_migrate
    from services.dag import migrate as dag_migrate

    core_migrate.upgrade(url)
    cron_migrate.upgrade(url)
    dag_migrate.upgrade(url)


def cmd_migrate(settings: CairnSettings, args: argparse.Namespace) -> int:
    _prepare_home(settings)
    url, started = _database(settings)
    try:
        migrate_all(url)
    finally:
        if started is not None:
            started.stop()
    print("every schema is at its newest migration")
    return 0


def cmd_token_create(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.core import admin

    _prepare_home(settings)
    url, started = _database(settings)
    try:
        migrate_all(url)
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


def cmd_cron(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.cron.__main__ import main

    main(args.rest)
    return 0


def cmd_dag(settings: CairnSettings, args: argparse.Namespace) -> int:
    from services.dag.__main__ import main

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
    """Start the database (embedded unless a URL is set), the services and a worker, and
    wait for Ctrl-C."""
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
        migrate_all(url)
        token = local_token(settings, url, "admin", "admin")
        worker_token = local_token(settings, url, "local-worker", "worker")
        cron_token = local_token(settings, url, "cron", "service")
        dag_token = local_token(settings, url, "dag", "service")
        core_url = f"http://{settings.bind_host}:{settings.core_port}"
        cron_url = f"http://{settings.bind_host}:{settings.cron_port}"
        dag_url = f"http://{settings.bind_host}:{settings.dag_port}"
        env = {
            **os.environ,
            "CAIRN_DATABASE_URL": url,
            "CAIRN_MIGRATE_ON_START": "false",
            "CAIRN_CRON_URL": cron_url,
            "CAIRN_DAG_URL": dag_url,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.core"], env=env, start_new_session=True
            )
        )
        _wait_ready(core_url, procs[0])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.cron"],
                env={**env, "CAIRN_URL": core_url, "CAIRN_TOKEN": cron_token},
                start_new_session=True,
            )
        )
        _wait_ready(cron_url, procs[-1])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.dag"],
                env={**env, "CAIRN_URL": core_url, "CAIRN_TOKEN": dag_token},
                start_new_session=True,
            )
        )
        _wait_ready(dag_url, procs[-1])
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
            f"  dashboard {core_url}/ui  (log in with the token below)\n"
            f"  cron      {cron_url}  (OpenAPI at {cron_url}/docs)\n"
            f"  dag       {dag_url}  (OpenAPI at {dag_url}/docs)\n"
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cairn", description="Cairn task scheduling")
    parser.add_argument("--home", type=Path, help="data directory (CAIRN_HOME)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the whole system on loopback").set_defaults(func=cmd_up)
    core = sub.add_parser("core", help="run core's API and loops", add_help=False)
    core.add_argument("rest", nargs=argparse.REMAINDER)
    core.set_defaults(func=cmd_core)
    cron = sub.add_parser("cron", help="run the cron service (API and engine)", add_help=False)
    cron.add_argument("rest", nargs=argparse.REMAINDER)
    cron.set_defaults(func=cmd_cron)
    dag = sub.add_parser("dag", help="run the DAG service (CAIRN_URL, CAIRN_TOKEN)", add_help=False)
    dag.add_argument("rest", nargs=argparse.REMAINDER)
    dag.set_defaults(func=cmd_dag)
    sub.add_parser("migrate", help="migrate every schema").set_defaults(func=cmd_migrate)
    sub.add_parser(
        "worker", help="run a worker agent (CAIRN_URL, CAIRN_TOKEN of a worker principal)"
    ).set_defaults(func=cmd_worker)
    token = sub.add_parser("token", help="manage bearer tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="create a principal's token and print it")
    create.add_argument("name")
    create.add_argument("--role", choices=ROLES, default="user")
    create.set_defaults(func=cmd_token_create)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    overrides = {"home": args.home} if args.home else {}
    settings = CairnSettings(**overrides)
    sys.exit(args.func(settings, args))
