"""Webhooks played as an attacker would (issue 28, findings 2, 4, 7 and 11): a receiver
that answers a huge body, targets on loopback, private and link-local addresses (also
reached by a name that changes its answer), redirects, and signing secrets at rest."""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic import command
from sqlalchemy.engine import make_url

from libs.common import egress
from libs.common.migrations import alembic_config
from services.core import migrate as core_migrate
from services.core.domain.notify import verify
from tests.support import (
    LOOPBACK_WEBHOOKS,
    Core,
    make_token,
    spawn_core,
    start_core,
    stop_process,
    wait_for,
)
from tests.support import free_port as pick_port
from tests.webhooks import Receiver, subscribe

# Tests here queue several test deliveries of one owner at once; the per-owner limit on
# them has its own test (tests/integration/core/test_notifications.py).
FAST = {
    "notify_interval_s": 0.05,
    "notify_backoff_base_s": 0.05,
    "notify_backoff_cap_s": 0.2,
    "notify_test_interval_s": 0.001,
}
HUGE = 200 * 1024 * 1024


class Hostile:
    """A receiver on 127.0.0.1 that answers every POST with ``status`` and a body of
    ``size`` bytes, streamed, or with a redirect to ``location``; counts what it sent."""

    def __init__(self, size: int = HUGE, status: int = 500, location: str | None = None):
        self.sent = 0
        self.hits = 0
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                hostile.hits += 1
                try:
                    self.send_response(302 if location else status, "Go away")
                    if location:
                        self.send_header("Location", location)
                    self.send_header("Content-Length", "0" if location else str(size))
                    self.end_headers()
                    chunk = b"internal-secret " * 65536  # 1 MiB
                    while not location and hostile.sent < size:
                        self.wfile.write(chunk)
                        hostile.sent += len(chunk)
                except OSError:
                    pass  # core stopped reading

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _answers(client: httpx.Client, subscription_id: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.get(f"/v1/subscriptions/{subscription_id}/answers").json()[
        "items"
    ]
    return items


def test_a_huge_answer_leaves_cores_memory_alone_and_only_an_excerpt_is_logged(
    db_url: str, tmp_path: Path, free_port: int
) -> None:
    """One 1.2 GB answer took core from 135 MB to 4.5 GB: the whole body was read. Now
    4 KiB of it at most, and 200 characters of that in the log."""
    hostile = Hostile()
    env = {
        "CAIRN_NOTIFY_ALLOW_CIDRS": LOOPBACK_WEBHOOKS,
        "CAIRN_NOTIFY_INTERVAL_S": "0.05",
        "CAIRN_NOTIFY_TIMEOUT_S": "60",
        "CAIRN_NOTIFY_BACKOFF_BASE_S": "600",
    }
    core = spawn_core(db_url, tmp_path, free_port, **env)
    token = make_token(db_url, "alice", "user")
    url = f"http://127.0.0.1:{free_port}"
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as alice:
            made = subscribe(alice, hostile.url, events=["run.failed"])
            before = _memory_kb(core.pid, "VmHWM")
            assert alice.post(f"/v1/subscriptions/{made['id']}/test").status_code == 202
            [answer] = wait_for(lambda: _answers(alice, made["id"]), timeout=60)
            grown_mb = (_memory_kb(core.pid, "VmHWM") - before) / 1024
    finally:
        stop_process(core)
        hostile.close()
    assert grown_mb < 32, f"core's peak memory grew by {grown_mb:.0f} MB"
    assert hostile.sent < 32 * 1024 * 1024, "core stopped reading the answer early"
    assert answer["status"] == 500
    assert answer["error"].startswith("HTTP 500 Go away: internal-secret internal-secret")
    assert len(answer["error"]) <= 240


@pytest.fixture
def free_port() -> int:
    return pick_port()


@pytest.fixture
def guarded(db_url: str, tmp_path: Path) -> Iterator[Core]:
    """A core with the default policy: nothing but public addresses."""
    server = start_core(db_url, tmp_path, **FAST, notify_allow_cidrs="")
    yield server
    server.stop()


REFUSED_URLS = [
    "http://127.0.0.1:8080/h",
    "https://127.0.0.1/h",
    "http://localhost:9000/h",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/h",
    "http://172.16.0.1/h",
    "http://192.168.0.1/h",
    "http://100.64.0.1/h",
    "http://0.0.0.0:5432/h",
    "http://[::1]/h",
    "http://[fd00::1]/h",
    "http://[fe80::1]/h",
    "http://[::ffff:127.0.0.1]/h",
    "http://[::ffff:169.254.169.254]/h",
]


def test_loopback_private_and_link_local_targets_are_refused_at_create(guarded: Core) -> None:
    with guarded.client() as alice:
        for url in REFUSED_URLS:
            body = {"name": "probe", "events": ["task.dead"], "url": url}
            answer = alice.post("/v1/subscriptions", json=body)
            assert answer.status_code == 422, (url, answer.text)
            assert answer.json()["errors"][0]["field"] == "body.url"
        assert alice.get("/v1/subscriptions").json() == {"items": []}
        subscribe(alice, "https://93.184.216.34/h")  # a public address
        # A name the resolver cannot even encode is left to delivery, not a 500.
        subscribe(alice, "https://" + "a" * 70 + ".example/h", name="long")


def test_the_databases_port_stays_refused_when_loopback_is_opened(
    db_url: str, tmp_path: Path
) -> None:
    server = start_core(db_url, tmp_path, notify_allow_cidrs=LOOPBACK_WEBHOOKS)
    port = make_url(db_url).port
    assert port is not None
    try:
        with server.client() as alice:
            body = {"name": "db", "events": ["task.dead"], "url": f"http://127.0.0.1:{port}/"}
            answer = alice.post("/v1/subscriptions", json=body)
            assert answer.status_code == 422
            assert answer.json()["errors"][0]["field"] == "body.url"
            subscribe(alice, f"http://127.0.0.1:{port + 1}/")
    finally:
        server.stop()


def test_a_host_that_resolves_to_loopback_after_create_is_refused_at_delivery(
    guarded: Core, db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check is made where the connection is: a name public at create and loopback
    later (DNS changed, or rebinding), and a URL stored before the deny list (here
    written in SQL), reach nothing; the log says refused, not why a port is closed."""
    hook = Receiver()
    port = int(hook.url.split(":")[2].split("/")[0])
    answers = iter(["93.184.216.34"] + ["127.0.0.1"] * 1000)
    system = socket.getaddrinfo

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "hooks.rebind.test":
            return system(next(answers), *args, **kwargs)
        return system(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    try:
        with guarded.client() as alice:
            named = subscribe(alice, f"http://hooks.rebind.test:{port}/hook", name="named")
            stored = subscribe(alice, "https://93.184.216.34/h", name="stored")
            db.execute(
                "UPDATE core.subscriptions SET url = %s WHERE id = %s", (hook.url, stored["id"])
            )
            for made in (named, stored):
                assert alice.post(f"/v1/subscriptions/{made['id']}/test").status_code == 202
            logged = [
                wait_for(lambda m=m: _answers(alice, m["id"]), timeout=20) for m in (named, stored)
            ]
    finally:
        hook.close()
    assert hook.all() == []
    for [answer] in logged:
        assert answer["status"] is None
        assert answer["error"] == f"could not deliver: {egress.REFUSED}"


def test_a_connection_failure_says_could_not_deliver_and_nothing_of_the_port(
    db_url: str, tmp_path: Path, free_port: int
) -> None:
    """Connect errors were the scanner: 'connection refused' against 'timed out'."""
    server = start_core(db_url, tmp_path, **FAST)
    try:
        with server.client() as alice:
            made = subscribe(alice, f"http://127.0.0.1:{free_port}/h", events=["run.failed"])
            assert alice.post(f"/v1/subscriptions/{made['id']}/test").status_code == 202
            [answer] = wait_for(lambda: _answers(alice, made["id"]), timeout=20)
    finally:
        server.stop()
    assert (answer["status"], answer["error"]) == (None, "could not deliver")


def test_a_redirect_is_not_followed(db_url: str, tmp_path: Path) -> None:
    inside = Receiver()
    hostile = Hostile(location=inside.url)
    server = start_core(db_url, tmp_path, **FAST)
    try:
        with server.client() as alice:
            made = subscribe(alice, hostile.url, events=["run.failed"])
            assert alice.post(f"/v1/subscriptions/{made['id']}/test").status_code == 202
            [answer] = wait_for(lambda: _answers(alice, made["id"]), timeout=20)
    finally:
        server.stop()
        hostile.close()
        inside.close()
    assert hostile.hits == 1
    assert inside.all() == []
    assert answer["status"] == 302


def test_the_signature_covers_the_timestamp_and_the_secret_is_stored_sealed(
    core_with_hooks: Core, db
) -> None:
    hook = Receiver()
    try:
        with core_with_hooks.client() as alice:
            made = subscribe(alice, hook.url, events=["run.failed"])
            assert alice.post(f"/v1/subscriptions/{made['id']}/test").status_code == 202
            wait_for(hook.accepted, timeout=20)
    finally:
        hook.close()
    secret = made["secret"]
    [row] = db.execute("SELECT row_to_json(s)::text FROM core.subscriptions s").fetchall()
    assert secret not in row[0]
    assert secret.removeprefix("whsec_") not in row[0]
    [got] = hook.all()
    stamp, header = got.headers["x-cairn-timestamp"], got.headers["x-cairn-signature"]
    assert header.startswith("v1=")
    assert verify(secret, got.body, stamp, header)
    # A replay of the same request an hour later is refused by its timestamp; moving the
    # timestamp forward breaks the signature.
    assert not verify(secret, got.body, stamp, header, now=int(stamp) + 3600)
    assert not verify(secret, got.body, str(int(time.time())), header, now=int(stamp) + 3600)


@pytest.fixture
def core_with_hooks(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path, **FAST)
    yield server
    server.stop()


def test_the_migration_seals_the_secrets_stored_before_it(
    db_url: str, tmp_path: Path, db, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = base64.urlsafe_b64encode(os.urandom(32)).decode()
    command.downgrade(alembic_config(core_migrate.MIGRATIONS, db_url), "0008_flow_last")
    hook = Receiver()
    db.execute(
        "INSERT INTO core.subscriptions (owner, name, events, url, secret) "
        "VALUES ('alice', 'old', ARRAY['run.failed'], %s, 'whsec_from_before')",
        (hook.url,),
    )
    # As compose's setup step runs it: production, the key and nothing else of core's.
    monkeypatch.setenv("CAIRN_ENV", "production")
    monkeypatch.setenv("CAIRN_DATABASE_URL", db_url)
    monkeypatch.setenv("CAIRN_HOME", str(tmp_path))
    monkeypatch.delenv("CAIRN_SECRETS_KEY", raising=False)
    with pytest.raises(RuntimeError, match="KEY_FILE is required when CAIRN_ENV=production"):
        core_migrate.upgrade(db_url)
    monkeypatch.setenv("CAIRN_ENV", "development")  # no key file made here: it is not core's
    with pytest.raises(RuntimeError, match="cannot read the secrets key file"):
        core_migrate.upgrade(db_url)
    assert not (tmp_path / "secrets.key").exists()
    assert db.execute("SELECT secret FROM core.subscriptions").fetchall() == [
        ("whsec_from_before",)
    ]
    monkeypatch.setenv("CAIRN_ENV", "production")
    monkeypatch.setenv("CAIRN_SECRETS_KEY", key)
    core_migrate.upgrade(db_url)
    monkeypatch.delenv("CAIRN_ENV")
    monkeypatch.delenv("CAIRN_DATABASE_URL")
    [row] = db.execute("SELECT id, row_to_json(s)::text FROM core.subscriptions s").fetchall()
    assert "whsec_from_before" not in row[1] and "from_before" not in row[1]
    server = start_core(db_url, tmp_path, **FAST, secrets_key=key)
    try:
        with server.client() as alice:
            assert alice.post(f"/v1/subscriptions/{row[0]}/test").status_code == 202
            wait_for(hook.accepted, timeout=20)
    finally:
        server.stop()
        hook.close()
    assert hook.accepted()[0].signed_by("whsec_from_before")
