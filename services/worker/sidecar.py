"""The sidecar: a process beside the agent that tells core, every heartbeat interval, that
the worker lives and which attempts' processes it sees alive. When the agent is gone it
stops beating (so core declares the worker dead), kills the attempts left behind and
removes the agent's egress table (``firewall``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from libs.common import logs
from libs.common.client import CoreClient
from libs.common.errors import CairnError
from services.worker import firewall, hardening, state
from services.worker.cgroups import AttemptCgroup
from services.worker.isolation import Identity, kill_every_process_of
from services.worker.settings import WorkerSettings

log = logging.getLogger("cairn.sidecar")


def _orphans_killed(shared: dict[str, Any]) -> None:
    """Kill every process the agent's attempts left: process groups, cgroups, uids."""
    attempts: dict[str, int] = shared.get("attempts", {})
    for pid in attempts.values():
        if pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    for folders in shared.get("cgroups", {}).values():
        for folder in folders[:1]:
            AttemptCgroup("v1", {"": Path(folder)}).kill_all()
    for uid in shared.get("uids", {}).values():
        kill_every_process_of(Identity(int(uid), int(uid)))


async def beat_forever(
    folder: Path,
    board: state.Board,
    worker_id: int,
    interval_s: float,
    timeout_s: float,
    client: CoreClient,
    home: Path | None = None,
) -> None:
    """Beat until the agent is gone. Cut off from core for nearly ``timeout_s``, after which
    core re-places this worker's attempts, it kills them here, so they never run twice."""
    loop = asyncio.get_running_loop()
    last_ok = loop.time()
    gone = _watch(os.getppid())
    while True:
        shared = board.read()
        agent = int(shared.get("agent_pid", 0))
        attempts: dict[str, int] = shared.get("attempts", {})
        if _agent_gone(agent, gone):
            log.warning(
                "the agent (pid %s) is gone; stopping its attempts and the heartbeat", agent
            )
            _orphans_killed(shared)
            if home is not None and agent:
                # after the kill: no process of the attempts is left to reach anything
                await asyncio.to_thread(firewall.delete, firewall.table_name(home, agent))
            await _last_word(client, worker_id, attempts)
            return
        # pid 0: claimed and being prepared by the (living) agent; -1: being started.
        living = [int(a) for a, pid in attempts.items() if pid <= 0 or state.alive(pid)]
        try:
            answer = await client.heartbeat(worker_id, living)
            state.write(folder / state.ANSWER, answer.model_dump())
            last_ok = loop.time()
        except (httpx.TransportError, CairnError) as exc:
            log.warning("heartbeat failed: %s", exc)
            if loop.time() - last_ok > max(timeout_s - interval_s, interval_s):
                log.error("cut off from core too long: stopping this worker's attempts")
                _orphans_killed(shared)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), interval_s)


def _agent_gone(agent: int, gone: asyncio.Event) -> bool:
    """Whether the agent (this process's parent) has exited. A SIGKILLed agent stays a
    zombie until its own parent reaps it, and ``kill(pid, 0)`` still finds a zombie:
    its pidfd, or this process being reparented, says it is gone."""
    return not agent or gone.is_set() or os.getppid() != agent or not state.alive(agent)


def _watch(agent_pid: int) -> asyncio.Event:
    """An event set the moment the agent exits (a pidfd), so its attempts are stopped and
    reported at once, not at the next heartbeat."""
    gone = asyncio.Event()
    try:
        pidfd = os.pidfd_open(agent_pid)
    except OSError:
        gone.set()
        return gone
    loop = asyncio.get_running_loop()

    def readable() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        gone.set()

    loop.add_reader(pidfd, readable)
    return gone


async def _last_word(client: CoreClient, worker_id: int, attempts: dict[str, int]) -> None:
    """Tell core which attempts had started (a pid, or -1: being started) before the agent
    died, so they count as crashes, then leave: they are lost at once."""
    started = [int(a) for a, pid in attempts.items() if pid != 0]
    with contextlib.suppress(httpx.HTTPError, CairnError):
        if started:
            await client.heartbeat(worker_id, started)
        await client.leave(worker_id)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cairn-sidecar", description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("worker_id", type=int)
    parser.add_argument("interval_s", type=float)
    parser.add_argument("timeout_s", type=float)
    parser.add_argument("board_fd", type=int, help="the agent's state.Board (an inherited memfd)")
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    logs.setup("sidecar", settings.log_level)
    secrets = json.loads(sys.stdin.read() or "{}")
    hardening.non_dumpable()

    async def run() -> None:
        async with CoreClient(settings.url, secrets.get("token")) as client:
            client.use_lease(secrets.get("lease", ""))
            await beat_forever(
                args.folder,
                state.Board(args.board_fd),
                args.worker_id,
                args.interval_s,
                args.timeout_s,
                client,
                settings.home,
            )

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
