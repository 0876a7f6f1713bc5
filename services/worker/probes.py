"""A service replica's probes (docs/services.md), run by its agent with Kubernetes'
semantics: a startup probe gates the other two; liveness and readiness then run side by
side. A probe tries every ``period_s`` from ``initial_delay_s`` after it starts, each try
bounded by ``timeout_s``; ``failure_threshold`` failures in a row fail it,
``success_threshold`` successes in a row pass it. A failed startup or liveness probe
kills the attempt (``Prober.fail``); readiness flips are told (``Prober.ready``).

HTTP and TCP probes connect to the replica's loopback: the host's, or, for an attempt
with egress ``none``, its own network namespace's (the socket is made in it:
``isolation.socket_in_network``). An exec probe runs the command as the attempt runs
(``executor.run_attempt`` with the attempt's sandbox: its uid, cgroup, private /tmp
and network), its output in a log of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from libs.common import waits
from libs.common.models import Probe, ServiceSpec
from services.worker.executor import AttemptSpec, run_attempt
from services.worker.isolation import socket_in_network

log = logging.getLogger("cairn.worker.probes")

LOOPBACK = "127.0.0.1"
#: the most of an HTTP answer read (its status line is all a probe needs)
MAX_STATUS_LINE = 1024


def pick_ports(service: ServiceSpec) -> dict[str, int]:
    """Each declared port's number: as declared, or (0) a free one the kernel picks."""
    ports: dict[str, int] = {}
    for port in service.ports:
        ports[port.name] = port.port or _free_port()
    return ports


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def port_env(ports: Mapping[str, int]) -> dict[str, str]:
    """``CAIRN_PORT_<NAME>`` for each port (upper case, ``-`` as ``_``)."""
    return {f"CAIRN_PORT_{name.upper().replace('-', '_')}": str(n) for name, n in ports.items()}


@dataclasses.dataclass
class Target:
    """The replica the probes look at: its ports, the process whose network namespace
    they enter (None: the host's), and its spec (exec probes run in its sandbox)."""

    spec: AttemptSpec
    ports: Mapping[str, int]
    netns_pid: int | None = None
    #: the replica's process, whose mount namespace exec probes enter (None: they make
    #: private mounts of their own)
    pid: int | None = None

    def port(self, ref: int | str) -> int:
        return ref if isinstance(ref, int) else self.ports[ref]


async def try_once(probe: Probe, target: Target) -> str | None:
    """One try of ``probe``: None when it succeeds, else why not."""
    try:
        async with asyncio.timeout(probe.timeout_s):
            if probe.exec is not None:
                return await _exec(probe.exec.command, probe.timeout_s, target)
            if probe.http is not None:
                return await _http(probe.http.path, target.port(probe.http.port), target)
            assert probe.tcp is not None
            sock = await _connect(target.port(probe.tcp.port), target)
            sock.close()
            return None
    except TimeoutError:
        return f"no answer within {probe.timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


async def _connect(port: int, target: Target) -> socket.socket:
    if target.netns_pid is not None:
        sock = socket_in_network(target.netns_pid)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (LOOPBACK, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _http(path: str, port: int, target: Target) -> str | None:
    sock = await _connect(port, target)
    reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_STATUS_LINE)
    try:
        request = (
            f"GET {path} HTTP/1.0\r\nHost: {LOOPBACK}:{port}\r\n"
            "User-Agent: cairn-probe\r\nConnection: close\r\n\r\n"
        )
        writer.write(request.encode())
        await writer.drain()
        try:
            line = await reader.readline()
        except ValueError:
            return "the answer's status line is too long"
        parts = line.decode("latin-1").split(maxsplit=2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            return f"not an HTTP answer: {line[:80]!r}"
        status = int(parts[1])
        return None if 200 <= status < 400 else f"HTTP {status} from GET {path}"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _exec(command: list[str], timeout_s: float, target: Target) -> str | None:
    spec = target.spec
    sandbox = spec.sandbox
    if sandbox is not None:
        joined = tuple(spec.cgroup.procs_files) if spec.cgroup is not None else ()
        sandbox = dataclasses.replace(
            sandbox,
            cgroup_procs=joined,
            netns=False,
            join_netns=target.netns_pid,
            join_mounts=target.pid if sandbox.private_tmp is not None else None,
        )
    probe = dataclasses.replace(
        spec,
        executable=Path(command[0]),
        args=command[1:],
        log_path=probe_log(spec),
        timeout_s=timeout_s,
        progress_timeout_s=None,
        kill_grace_s=0.0,
        sandbox=sandbox,
        cgroup=None,
        helper=None,
        log_max_bytes=64 * 1024,
    )
    result = await run_attempt(probe)
    if result.outcome == "succeeded":
        return None
    said = result.log_tail.strip().splitlines()[-1:] or [""]
    why = result.error or result.outcome
    return f"{' '.join(command)}: {why}" + (f": {said[0][:200]}" if said[0] else "")


def probe_log(spec: AttemptSpec) -> Path:
    """Where an attempt's exec probes write their output (removed with ``Prober.close``)."""
    return spec.log_path.with_name(f"{spec.attempt_id}.probe.log")


class Prober:
    """The probes of one replica: ``run`` until cancelled or a probe kills it. ``fail``
    is called with why a startup or liveness probe failed; ``ready`` with each readiness
    flip (the first: False, then True once it passes; True at once without a readiness
    probe, after the startup probe)."""

    def __init__(
        self,
        service: ServiceSpec,
        target: Target,
        fail: Callable[[str], None],
        ready: Callable[[bool], None],
    ) -> None:
        self.service = service
        self.target = target
        self.fail = fail
        self.ready = ready

    async def run(self) -> None:
        self.ready(False)
        startup, liveness = self.service.startup, self.service.liveness
        if startup is not None:
            why = await self._until(startup, passes=True)
            if why is not None:
                self.fail(f"startup probe failed: {why}")
                return
        readiness: asyncio.Task[None] | None = None
        if self.service.readiness is None:
            self.ready(True)
        else:
            readiness = asyncio.create_task(self._readiness(self.service.readiness))
        try:
            if liveness is not None:
                why = await self._until(liveness, passes=False)
                if why is not None:
                    self.fail(f"liveness probe failed: {why}")
            elif readiness is not None:
                await readiness
        finally:
            if readiness is not None:
                # not under suppress(CancelledError): that swallowed a cancel of this
                # task's own that came while it waited
                await waits.stop(readiness)

    async def _until(self, probe: Probe, passes: bool) -> str | None:
        """Try ``probe`` on its period until it fails (why) or, with ``passes``, until it
        passes (None)."""
        failures = successes = 0
        async for why in self._tries(probe):
            if why is None:
                failures, successes = 0, successes + 1
                if passes and successes >= probe.success_threshold:
                    return None
            else:
                failures, successes = failures + 1, 0
                if failures >= probe.failure_threshold:
                    return why
        return None  # never: the tries go on until cancelled

    async def _readiness(self, probe: Probe) -> None:
        ready, failures, successes = False, 0, 0
        async for why in self._tries(probe):
            if why is None:
                failures, successes = 0, successes + 1
            else:
                failures, successes = failures + 1, 0
            if not ready and successes >= probe.success_threshold:
                ready = True
                self.ready(True)
            elif ready and failures >= probe.failure_threshold:
                ready = False
                log.info("attempt %s not ready: %s", self.target.spec.attempt_id, why)
                self.ready(False)

    async def _tries(self, probe: Probe) -> AsyncIterator[str | None]:
        loop = asyncio.get_running_loop()
        due = loop.time() + probe.initial_delay_s
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = max(due + probe.period_s, loop.time())
            try:
                yield await try_once(probe, self.target)
            except Exception as exc:  # a probe's own fault counts as a failed try
                log.exception("a probe of attempt %s failed", self.target.spec.attempt_id)
                yield f"the probe could not run: {exc}"

    def close(self) -> None:
        probe_log(self.target.spec).unlink(missing_ok=True)
