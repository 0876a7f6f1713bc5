"""The compose deployment brought up on a private engine, and what the test needs of it:
the published ports, an HTTP client per service, and its containers by service."""

from __future__ import annotations

import base64
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tests.deploy import images
from tests.deploy.engine import EngineError, PrivateEngine
from tests.support import free_port

COMPOSE_FILE = images.ROOT / "compose" / "docker-compose.yml"
PORTS = ("CORE_1", "CORE_2", "CRON_1", "CRON_2", "DAG")
EXAMPLES = "/usr/share/cairn/examples"  # compose/Dockerfile puts cairn/demo there
UP_TIMEOUT_S = 240


def _when(stamp: str) -> datetime:
    """An engine's timestamp (nanoseconds, ``Z``) as a datetime."""
    day, _, rest = stamp.rstrip("Z").partition("T")
    clock, _, fraction = rest.partition(".")
    return datetime.fromisoformat(f"{day}T{clock}.{(fraction + '000000')[:6]}+00:00")


@dataclass
class Stack:
    engine: PrivateEngine
    folder: Path
    project: str
    ports: dict[str, int] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    _clients: dict[str, httpx.Client] = field(default_factory=dict)
    began: datetime = field(default_factory=lambda: datetime.now(UTC))
    healthy_at: dict[str, float] = field(default_factory=dict)

    @property
    def env_file(self) -> Path:
        return self.folder / "deploy.env"

    def write_env(self) -> None:
        self.ports = {name: free_port() for name in PORTS}
        self.secrets = {
            name: secrets.token_hex(20)
            for name in ("DB_PASSWORD", "ADMIN_TOKEN", "CRON_TOKEN", "DAG_TOKEN", "WORKER_TOKEN")
        }
        lines = [f"CAIRN_{k}={v}" for k, v in self.secrets.items()]
        lines += [f"CAIRN_PORT_{k}={v}" for k, v in self.ports.items()]
        core_origins = ",".join(f"http://127.0.0.1:{self.ports[c]}" for c in ("CORE_1", "CORE_2"))
        lines += [
            f"CAIRN_IMAGE={images.CAIRN_IMAGE}",
            # Health seen within 2 s of being there (the engine probes first after one
            # interval); the file's default is 5 s.
            "CAIRN_HEALTHCHECK_INTERVAL=2s",
            f"CAIRN_UI_ORIGINS={core_origins}",
            # Short, so that a killed worker is declared dead within seconds (not shorter: a
            # sidecar of a loaded host may take some seconds to start beating).
            "CAIRN_HEARTBEAT_INTERVAL_S=1",
            "CAIRN_HEARTBEAT_TIMEOUT_S=15",
            "CAIRN_WORKER_DRAIN_GRACE_S=5",
            # Where the test's artifacts come from (the examples in the image), for an
            # allow-list of sources; and a key to seal secrets with, where core wants one.
            f"CAIRN_ARTIFACT_SOURCES=file://{EXAMPLES}/",
            f"CAIRN_SECRETS_KEY={base64.urlsafe_b64encode(os.urandom(32)).decode()}",
        ]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.env_file.write_text("\n".join(lines) + "\n")

    def compose(self, *args: str, timeout: float = 300) -> str:
        done = self.engine.compose(
            "--project-name",
            self.project,
            "--file",
            str(COMPOSE_FILE),
            "--env-file",
            str(self.env_file),
            *args,
            timeout=timeout,
        )
        return done.stdout

    def up(self, workers: int) -> None:
        self.began = datetime.now(UTC)
        clock = time.monotonic()
        self.compose(
            "up", "--detach", "--no-build", "--scale", f"worker={workers}", timeout=UP_TIMEOUT_S
        )
        deadline = time.monotonic() + UP_TIMEOUT_S
        while (waiting := self._waiting()) and time.monotonic() < deadline:
            for service in self._services() - {s for s, _ in waiting} - {"setup"}:
                self.healthy_at.setdefault(service, time.monotonic() - clock)
            time.sleep(0.5)
        if waiting:
            raise EngineError(f"not healthy after {UP_TIMEOUT_S} s: {waiting}\n{self.logs()}")
        for service in self._services() - {"setup"}:
            self.healthy_at.setdefault(service, time.monotonic() - clock)

    def timeline(self) -> dict[str, float]:
        """Seconds from ``up`` to: the setup job's start and end, each service's first
        container start, and the moment ``up`` saw each service healthy (its last replica),
        with how often containers restarted meanwhile, for the summary."""
        marks: dict[str, float] = {}
        restarts = 0
        for c in self.containers():
            service = c["Config"]["Labels"]["com.docker.compose.service"]
            state = c["State"]
            restarts += int(c["RestartCount"])
            at = (_when(state["StartedAt"]) - self.began).total_seconds()
            key = f"  up: {service} started at"
            marks[key] = min(marks.get(key, at), at)
            if service == "setup":
                marks["  up: setup ended at"] = (
                    _when(state["FinishedAt"]) - self.began
                ).total_seconds()
        for service, at in self.healthy_at.items():
            marks[f"  up: {service} healthy at"] = at
        found = dict(sorted(marks.items(), key=lambda item: item[1]))
        found["  up: restarts meanwhile"] = restarts
        return found

    def close(self) -> None:
        """The clients; the engine's ``close`` removes the containers, all at once."""
        for client in self._clients.values():
            client.close()

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40")[-12000:]

    # --- containers ---

    def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        """The project's containers (of ``service``), inspected, in name order."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = self.engine.docker("ps", "-aq", *filters).stdout.split()
        found = [self.engine.inspect(i) for i in ids]
        return sorted(found, key=lambda c: str(c["Name"]))

    def not_healthy(self) -> list[str]:
        """Containers that should run and are not running healthy (setup ends by design)."""
        return [what for _, what in self._waiting()]

    def _services(self) -> set[str]:
        return {c["Config"]["Labels"]["com.docker.compose.service"] for c in self.containers()}

    def _waiting(self) -> list[tuple[str, str]]:
        waiting = []
        for c in self.containers():
            service = c["Config"]["Labels"]["com.docker.compose.service"]
            state = c["State"]
            if service == "setup":
                if state["Status"] == "exited" and state["ExitCode"] != 0:
                    raise EngineError(f"setup failed:\n{self.logs()}")
                continue
            health = state.get("Health", {}).get("Status")
            if state["Status"] != "running" or health not in (None, "healthy"):
                waiting.append((service, f"{c['Name']}: {state['Status']}/{health}"))
        return waiting

    def kill(self, container: dict[str, Any]) -> None:
        """SIGKILL the container's pid 1 from the host, as a crash would: the engine sees
        it die on its own, so its restart policy applies (``docker kill`` would count as
        a stop by hand)."""
        pid = int(self.engine.inspect(container["Id"])["State"]["Pid"])
        assert pid > 0, f"{container['Name']} does not run"
        os.kill(pid, signal.SIGKILL)

    # --- HTTP ---

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def client(self, port: str) -> httpx.Client:
        """An admin's client of the service published as ``port`` (kept until ``down``)."""
        if port not in self._clients:
            headers = {"Authorization": f"Bearer {self.secrets['ADMIN_TOKEN']}"}
            self._clients[port] = httpx.Client(base_url=self.url(port), headers=headers, timeout=10)
        return self._clients[port]
