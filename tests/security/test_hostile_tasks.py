"""Hostile tasks against a real worker agent running as root (``python -m services.worker``)
and a real core: each task tries an attack from docs/security.md, and the test asserts
that it failed, from the task's own log and from what the database holds."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import http.server
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.worker.artifacts import QUIET_NS
from tests.support import (
    Core,
    isolation_env,
    make_token,
    shared_dir,
    start_core,
    stop_process,
    wait_for,
)
from tests.support.procs import children
from tests.support.tls import loopback_cert

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the agent must run as root to isolate"),
]

SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()
PIDS_MAX = 64
DB_URL_MARK = "postgresql://never-for-workers:s3cret@db.invalid/cairn"


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path / "core", heartbeat_interval_s=0.2, heartbeat_timeout_s=10)
    yield server
    server.stop()


class Agent:
    """A root agent with a token file, as production runs it."""

    def __init__(
        self,
        core: Core,
        home: Path,
        name: str = "w",
        session_keyring: bool = False,
        **env: str,
    ) -> None:
        self.token = make_token(core.db_url, name, "worker")
        home.mkdir(parents=True, mode=0o700)
        token_file = home / "token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        self.isolation = isolation_env()
        self.run_dir = Path(self.isolation["CAIRN_WORKER_RUN_DIR"])
        self.home = home
        environment = {
            **os.environ,
            "CAIRN_URL": core.url,
            "CAIRN_TOKEN_FILE": str(token_file),
            # Given on purpose, as `cairn up` used to: the agent must drop it unread.
            "CAIRN_DATABASE_URL": DB_URL_MARK,
            "CAIRN_HOME": str(home),
            "CAIRN_WORKER_CPU": "2",
            "CAIRN_WORKER_MEMORY_MB": "4096",
            "CAIRN_WORKER_DRAIN_GRACE_S": "30",
            "CAIRN_WORKER_PIDS_MAX": str(PIDS_MAX),
            "CAIRN_LOG_LEVEL": "warning",
            **self.isolation,
            **env,
        }
        environment.pop("CAIRN_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker"],
            env=environment,
            # As systemd starts a service (KeyringMode=private): a session keyring its own.
            preexec_fn=join_session_keyring if session_keyring else None,
        )

    def sidecar_pid(self) -> int:
        def find() -> int | None:
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        status = (entry / "status").read_text()
                        cmdline = (entry / "cmdline").read_bytes()
                    except OSError:
                        continue
                    if f"PPid:\t{self.proc.pid}\n" in status and b"sidecar" in cmdline:
                        return int(entry.name)
            return None

        return int(wait_for(find, timeout=30))


def join_session_keyring() -> None:
    """Join a new anonymous session keyring (keyctl(2) on x86-64)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(250, ctypes.c_long(1), None) < 0:
        raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        stop_process(agent.proc, signal.SIGKILL)


def shell(script: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "hostile",
        "artifact": {"uri": f"file://{SH}", "sha256": SH_SHA},
        "args": ["-c", script],
        "retry": {"max_attempts": 1},
    }
    body.update(extra)
    return body


def run(core: Core, body: dict[str, Any], until: tuple[str, ...] = ("succeeded", "dead")) -> dict:
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=body).json()
        try:
            wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] in until, 60)
        except AssertionError:
            print(alice.get(f"/v1/tasks/{task['id']}/events").json())
            print(alice.get(f"/v1/tasks/{task['id']}/attempts").json())
            raise
        final = alice.get(f"/v1/tasks/{task['id']}").json()
        final["attempts_list"] = alice.get(f"/v1/tasks/{task['id']}/attempts").json()["items"]
        final["log"] = alice.get(f"/v1/tasks/{task['id']}/logs").text
    return final


def test_an_attempt_runs_unprivileged_with_its_own_uid_folder_and_tmp(core, agents, tmp_path):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    script = (
        "id; grep -E '^(CapEff|CapPrm|NoNewPrivs|Groups)' /proc/self/status; "
        'stat -c "home %a %u" "$HOME"; pwd; echo "tmpdir $TMPDIR"; '
        "echo mine > /tmp/left-behind; ls -a /tmp | tr '\\n' ' '"
    )
    first = run(core, shell(script))
    second = run(core, shell("ls -a /tmp | tr '\\n' ' '; echo; cat /tmp/left-behind"))

    log = first["log"]
    uid = int(re.search(r"uid=(\d+)", log).group(1))
    first_uid, _, last_uid = agent.isolation["CAIRN_WORKER_UIDS"].partition("-")
    assert int(first_uid) <= uid <= int(last_uid), log
    assert f"gid={uid} groups={uid}\n" in log and "Groups:\t \n" in log, log
    assert "CapEff:\t0000000000000000" in log and "CapPrm:\t0000000000000000" in log, log
    assert "NoNewPrivs:\t1" in log, log
    assert f"home 700 {uid}" in log, log
    assert "left-behind" in log  # its own /tmp is writable...
    assert "mine" not in second["log"] and "No such file" in second["log"]  # ...and private


def test_the_token_and_database_url_are_unreadable(core, agents, tmp_path):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    sidecar = agent.sidecar_pid()
    script = (
        "cat /proc/$PPID/environ; echo parent=$?; "
        f"cat /proc/{sidecar}/environ; echo sidecar=$?; "
        "cat /proc/$PPID/cmdline /proc/*/cmdline 2>/dev/null | tr '\\0' ' '; "
        "for f in /proc/[0-9]*/environ; do cat $f 2>/dev/null; done | tr '\\0' '\\n'; "
        f"cat {agent.home}/token; echo file=$?; env"
    )
    final = run(core, shell(script))

    log = final["log"]
    assert "parent=1" in log and "sidecar=1" in log and "file=1" in log, log
    assert agent.token not in log and "s3cret" not in log, log
    assert "lease_" not in log, log
    # The agent removed both from its own environment, as the kernel shows it.
    for pid in (agent.proc.pid, sidecar):
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert agent.token.encode() not in environ and b"s3cret" not in environ


def test_another_attempts_folder_log_and_tmp_are_unreadable(core, agents, tmp_path, db):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    ready = shared_dir() / "ready"
    victim_script = (
        f'echo victim-secret > "$HOME/secret"; echo victim-secret; touch {ready}; sleep 30'
    )
    with core.client() as alice:
        victim = alice.post("/v1/tasks", json=shell(victim_script)).json()
        wait_for(ready.exists, timeout=60)
    [(attempt,)] = db.execute(
        "SELECT id FROM core.attempts WHERE task_id = %s", (victim["id"],)
    ).fetchall()
    folder = agent.run_dir / str(attempt)
    log = agent.home / "logs" / f"{attempt}.log"
    script = (
        f"cat {folder}/secret; ls {folder}; ls {agent.run_dir}; cat {log}; ls {agent.home}; "
        f"cat {folder}/tmp/*; echo done"
    )
    final = run(core, shell(script))

    assert "done" in final["log"] and "victim-secret" not in final["log"], final["log"]
    assert "Permission denied" in final["log"]


def test_the_executable_and_the_artifact_cache_cannot_be_changed(core, agents, tmp_path):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    cache = agent.home / "artifacts"
    script = (
        'echo "echo pwned" > "$0"; echo self=$?; '
        f"ls {cache}; echo cache=$?; touch {cache}/x; echo touch=$?; "
        f"cp /bin/false {agent.run_dir}/.exe/x; echo exe=$?"
    )
    attack = run(core, shell(script))
    after = run(core, shell("echo honest"))

    assert "self=1" in attack["log"] or "self=2" in attack["log"], attack["log"]
    assert "cache=2" in attack["log"] and "touch=1" in attack["log"], attack["log"]
    assert "exe=1" in attack["log"], attack["log"]
    assert after["state"] == "succeeded" and after["log"].strip() == "honest"
    assert SH.read_bytes() == Path("/bin/sh").read_bytes()


def test_the_agent_and_its_sidecar_cannot_be_signalled(core, agents, tmp_path, db):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    sidecar = agent.sidecar_pid()
    final = run(core, shell(f"kill -9 $PPID; echo agent=$?; kill -9 {sidecar}; echo sidecar=$?"))

    assert "agent=1" in final["log"] and "sidecar=1" in final["log"], final["log"]
    assert agent.proc.poll() is None and Path(f"/proc/{sidecar}").exists()
    assert final["state"] == "succeeded"


def test_a_host_file_cannot_be_read_as_an_artifact_and_no_digest_is_revealed(
    core, agents, tmp_path
):
    agents.append(Agent(core, tmp_path / "w"))
    folder = shared_dir()
    secret = folder / "secret.sh"
    secret.write_text("#!/bin/sh\necho the-host-secret\n")
    secret.chmod(0o600)  # root's
    real = hashlib.sha256(secret.read_bytes()).hexdigest()
    for claimed in ("0" * 64, real):
        final = run(core, {**shell(""), "artifact": {"uri": secret.as_uri(), "sha256": claimed}})
        assert final["state"] == "dead"
        assert "not readable by the attempt" in final["last_error"], final["last_error"]
        assert real not in final["last_error"] + final["log"] + str(final["attempts_list"])
    readable = folder / "public.sh"
    readable.write_text("#!/bin/sh\necho public\n")
    readable.chmod(0o644)
    mismatch = run(core, {**shell(""), "artifact": {"uri": readable.as_uri(), "sha256": "0" * 64}})
    assert "sha256 mismatch" in mismatch["last_error"]
    assert hashlib.sha256(readable.read_bytes()).hexdigest() not in str(mismatch)
    assert not [p for p in folder.iterdir() if p.name not in ("secret.sh", "public.sh")]


def test_a_file_artifact_changed_after_a_verified_run_is_refused_and_never_run(
    core, agents, tmp_path
):
    agents.append(Agent(core, tmp_path / "w"))
    folder = shared_dir()
    good, evil = b"#!/bin/sh\necho verified-bytes\n", b"#!/bin/sh\necho attacker-bytes\n"
    in_place, renamed = folder / "in_place.sh", folder / "renamed.sh"
    for path in (in_place, renamed):
        path.write_bytes(good)
        path.chmod(0o755)
    # Changed longer ago than the agent's quiet time: their digests are remembered.
    time.sleep(QUIET_NS / 1e9 + 0.2)

    def body(path: Path) -> dict[str, Any]:
        artifact = {"uri": path.as_uri(), "sha256": hashlib.sha256(good).hexdigest()}
        return {**shell(""), "args": [], "artifact": artifact}

    for path in (in_place, renamed, in_place, renamed):
        ran = run(core, body(path))
        assert ran["state"] == "succeeded" and "verified-bytes" in ran["log"], ran
    before = in_place.stat()
    with in_place.open("r+b") as f:
        f.write(evil)  # the same size, and the same mtime put back
    os.utime(in_place, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = in_place.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    replacement = folder / "replacement.sh"
    replacement.write_bytes(evil)
    replacement.chmod(0o755)
    was = renamed.stat()
    os.utime(replacement, ns=(was.st_atime_ns, was.st_mtime_ns))
    os.replace(replacement, renamed)
    for path in (in_place, renamed):
        final = run(core, body(path))
        assert final["state"] == "dead", final
        assert "sha256 mismatch" in final["last_error"], final["last_error"]
        assert "attacker-bytes" not in final["log"] + str(final["attempts_list"])


def test_a_memory_hog_split_over_processes_is_stopped_at_the_attempts_limit(core, agents, tmp_path):
    agents.append(Agent(core, tmp_path / "w"))
    hog = "import time; b = bytearray(60 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(2); print('hog-done')"
    script = f'for i in 1 2 3 4; do python3 -c "{hog}" & done; wait; echo survived'
    final = run(core, shell(script, resources={"cpu": 1, "memory_mb": 64}))

    [attempt] = final["attempts_list"]
    assert attempt["outcome"] == "oom_killed", final
    assert "64 MB" in attempt["error"]
    assert attempt["peak_memory_mb"] <= 64.5
    assert final["log"].count("hog-done") < 4, final["log"]


def test_a_fork_bomb_stops_at_the_pids_limit(core, agents, tmp_path):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(300):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(f'started={n}', flush=True)\n"
    )
    final = run(core, shell(f'python3 -c "{bomb}"'))

    started = int(final["log"].split("started=")[1].split()[0])
    assert started < PIDS_MAX, final["log"]
    assert agent.proc.poll() is None


def test_an_attempt_that_started_counts_as_a_crash_when_its_agent_dies(core, agents, tmp_path, db):
    """With no heartbeat in between (the interval is long), the sidecar still tells core
    the attempt had started: kill -9 of the agent costs the task its poison-pill budget."""
    slow = start_core(
        core.db_url, tmp_path / "slow", heartbeat_interval_s=30, heartbeat_timeout_s=90
    )
    try:
        started = shared_dir() / "started"
        agent = Agent(slow, tmp_path / "w")
        agents.append(agent)
        with slow.client() as alice:
            body = shell(f"touch {started}; sleep 30", retry={"max_attempts": 5, "poison_after": 1})
            task = alice.post("/v1/tasks", json=body).json()
            wait_for(started.exists, timeout=60)
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait()
            wait_for(lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "dead", 30)
            final = alice.get(f"/v1/tasks/{task['id']}").json()
    finally:
        slow.stop()
    assert db.execute("SELECT crashes FROM core.tasks").fetchone() == (1,)
    assert "poison pill" in (final.get("pending_reason") or "") or final["state"] == "dead"


def test_a_draining_agent_still_obeys_cancel(core, agents, tmp_path, db):
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    started = shared_dir() / "started"
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=shell(f"touch {started}; sleep 60")).json()
        wait_for(started.exists, timeout=60)
        agent.proc.send_signal(signal.SIGTERM)  # drain: 30 s of grace
        assert alice.post(f"/v1/tasks/{task['id']}/cancel").status_code == 200
        assert agent.proc.wait(timeout=20) == 0  # well inside the grace period
    assert db.execute("SELECT state FROM core.tasks").fetchone() == ("cancelled",)


def test_a_worker_outside_the_allow_list_refuses_the_artifact(core, agents, tmp_path):
    agents.append(Agent(core, tmp_path / "w", CAIRN_ARTIFACT_SOURCES="file:///opt/jobs/"))
    final = run(core, shell("echo ran"))
    assert final["state"] == "dead"
    assert "not an allowed artifact source" in final["last_error"]


def _spawn_helpers(agent_pid: int) -> list[int]:
    """The agent's resident spawn helpers (``cairn-spawn``), by their parent and name."""
    return [proc.pid for proc in children(agent_pid) if b"cairn-spawn" in proc.cmdline]


def test_the_fast_path_reuses_a_cgroup_without_leaking_the_last_attempt(core, agents, tmp_path):
    """Attempts started by the resident helper: the same pooled cgroup (one slot) serves
    both, with its limits; the second finds no process, file or secret of the first."""
    agent = Agent(core, tmp_path / "w", CAIRN_WORKER_SLOTS="1")
    agents.append(agent)
    shared = shared_dir()
    first = run(
        core,
        shell(
            f"setsid sleep 300 & echo $! > {shared}/stray; echo first-secret > /tmp/mine; "
            "cat /proc/self/cgroup",
            resources={"cpu": 0.5, "memory_mb": 96},
        ),
    )
    helpers = _spawn_helpers(agent.proc.pid)
    if not helpers:
        pytest.skip("no C compiler here: attempts are forked by the agent")
    stray = int((shared / "stray").read_text())
    helper_reads = " ".join(f"cat /proc/{pid}/environ; echo helper=$?;" for pid in helpers)
    second = run(
        core,
        shell(
            f"cat /proc/self/cgroup; grep -E '^(State|ShdPnd)' /proc/{stray}/status "
            "2>/dev/null || echo stray=gone; cat /tmp/mine; "
            f"{helper_reads} cat {agent.home}/token; echo file=$?; "
            "cat /sys/fs/cgroup/memory$(grep :memory: /proc/self/cgroup | cut -d: -f3)"
            "/memory.limit_in_bytes",
        ),
    )
    assert first["state"] == second["state"] == "succeeded", (first, second)
    slot = re.search(r":memory:(\S+/s\d+)\n", first["log"])
    assert slot is not None, first["log"]  # a pooled slot, not a cgroup per attempt
    assert f":memory:{slot.group(1)}\n" in second["log"], second["log"]
    # Killed: gone, a zombie, or (on a loaded machine) SIGKILL pending, about to die.
    pending = re.search(r"ShdPnd:\s*([0-9a-f]+)", second["log"])
    assert (
        "stray=gone" in second["log"]
        or re.search(r"State:\s*Z", second["log"])
        or (pending and int(pending.group(1), 16) & 1 << (signal.SIGKILL - 1))
    ), second["log"]
    assert "first-secret" not in second["log"], second["log"]
    assert second["log"].count("helper=1") == len(helpers), second["log"]
    assert "file=1" in second["log"] and agent.token not in second["log"]
    assert f"{512 * 2**20}\n" in second["log"], second["log"]  # its own limit, not 96 MB


class _TLSOrigin:
    """An https server on 127.0.0.1 with a certificate of its own (the agent trusts it
    through ``SSL_CERT_FILE``): ``routes`` answer 200, ``redirects`` a 302 to their
    Location; every request's path is kept in ``asked``."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.routes: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.asked: list[str] = []
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                origin.asked.append(self.path)
                if self.path in origin.redirects:
                    self.send_response(302)
                    self.send_header("Location", origin.redirects[self.path])
                    body = b""
                else:
                    body = origin.routes.get(self.path, b"")
                    self.send_response(200 if self.path in origin.routes else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.base = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def origins(tmp_path: Path) -> Iterator[tuple[_TLSOrigin, _TLSOrigin, Path]]:
    """Two https origins on loopback: the allowed one and one outside the allow-list."""
    cert, key = loopback_cert(tmp_path / "tls")
    allowed, outside = _TLSOrigin(cert, key), _TLSOrigin(cert, key)
    yield allowed, outside, cert
    allowed.stop()
    outside.stop()


def test_a_redirect_outside_the_allow_list_is_refused_before_it_is_followed(
    core, agents, tmp_path, origins
):
    """Finding 5 of issue 28: the allow-list held for the first URI only, and the agent
    followed the redirect wherever it led. Now every hop is checked before it is asked:
    the outside origin hears nothing and the attempt fails for good, naming the hop; a
    redirect inside the list (a presigned URL's shape) is still followed, and https never
    leads to http."""
    allowed, outside, cert = origins
    sh = SH.read_bytes()
    allowed.routes["/jobs/sh-real"] = sh
    allowed.redirects = {
        "/jobs/sh?X-Amz-Signature=s3cret": f"{allowed.base}/jobs/sh-real",
        "/jobs/away": f"{outside.base}/jobs/sh",
        "/jobs/down": f"http://127.0.0.1:{outside.httpd.server_address[1]}/jobs/sh",
    }
    outside.routes["/jobs/sh"] = sh
    agents.append(
        Agent(
            core,
            tmp_path / "w",
            CAIRN_ARTIFACT_SOURCES=f"{allowed.base}/jobs/",
            SSL_CERT_FILE=str(cert),
        )
    )

    def fetched(path: str) -> dict:
        artifact = {"uri": allowed.base + path, "sha256": SH_SHA}
        return run(core, shell("echo ran", artifact=artifact, retry={"max_attempts": 3}))

    # The refused ones first: once fetched, the digest is cached and not fetched again.
    away, down = fetched("/jobs/away"), fetched("/jobs/down")
    followed = fetched("/jobs/sh?X-Amz-Signature=s3cret")

    assert followed["state"] == "succeeded", followed
    assert "ran" in followed["log"]
    assert away["state"] == down["state"] == "dead"
    assert len(away["attempts_list"]) == 1, away["attempts_list"]  # not retried
    assert (
        f"redirected to {outside.base}/jobs/sh, which is not an allowed artifact source"
        in (away["last_error"])
    )
    assert "a downgrade from https to http" in down["last_error"]
    assert outside.asked == []


LOG_CAP = 2**20


def test_a_flood_of_output_keeps_the_workers_log_file_to_the_bound(db_url, agents, tmp_path):
    """Finding 6 of issue 28: the attempt's log file on the worker had no bound (800 MB
    in 2 s) while core kept its last 16 MiB. Now the file keeps what core keeps, the
    last CAIRN_LOG_MAX_BYTES (1 MiB here, core's too), with core's marker first: sampled
    every few milliseconds while ``yes`` writes as fast as it can, it never holds more
    than a quarter over the bound (and a pipe's worth); the task runs on to its end, and
    core's copy is the log's end under its own marker."""
    core = start_core(db_url, tmp_path / "core", log_max_bytes=LOG_CAP)
    agent = Agent(core, tmp_path / "w", CAIRN_LOG_MAX_BYTES=str(LOG_CAP))
    agents.append(agent)
    bound = LOG_CAP * 5 // 4 + 64 * 1024 + 200
    seen = {"largest": 0, "head": b""}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.003):
            for path in (agent.home / "logs").glob("*.log"):
                with contextlib.suppress(OSError), path.open("rb") as log:
                    size = os.fstat(log.fileno()).st_size
                    if size > seen["largest"]:
                        seen["largest"], seen["head"] = size, log.read(200)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with core.client() as alice:
            task = alice.post("/v1/tasks", json=shell("timeout 4 yes; echo flood-over")).json()

            def ended() -> bool:
                if seen["largest"] > bound:  # the old code: stop before the disk fills
                    alice.post(f"/v1/tasks/{task['id']}/cancel")
                    raise AssertionError(f"the worker's log grew to {seen['largest']} bytes")
                return alice.get(f"/v1/tasks/{task['id']}").json()["state"] in ("succeeded", "dead")

            wait_for(ended, timeout=60, interval=0.05)
            final = alice.get(f"/v1/tasks/{task['id']}").json()
            log = alice.get(f"/v1/tasks/{task['id']}/logs")
    finally:
        stop.set()
        sampler.join()
        core.stop()

    assert final["state"] == "succeeded", final
    assert LOG_CAP < seen["largest"] <= bound, seen["largest"]
    assert re.match(
        rb"\[cairn: the first \d+ bytes of this log were dropped: an attempt keeps its last"
        rb" 1 MiB\]\ny\ny\n",
        seen["head"],
    ), seen["head"]
    text = log.text
    assert log.headers["X-Cairn-Log-Truncated"] == "true"
    assert text.startswith("[cairn: the first "), text[:200]
    assert text.endswith("y\nflood-over\n"), text[-200:]
    assert len(text.encode()) <= LOG_CAP + 64 * 1024 + 200  # core trims whole chunks
    lines = text.splitlines()
    assert set(lines[:-1]) - {"y"} <= {line for line in lines if line.startswith("[cairn: ")}
