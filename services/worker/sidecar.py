"""The sidecar: a process beside the agent that tells core, every heartbeat interval, that
the worker lives and which attempts its agent holds. When the agent is gone it
stops beating (so core declares the worker dead), kills the attempts left behind and
removes the agent's egress table (``firewall``); when the agent lives but its loop stands
still (hung: its pulse on the board stops) for half the hang bound, it kills the
attempts, tells core they are lost, and beats no more."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from libs.common import logs, procs, waits
from libs.common.client import CoreClient
from libs.common.errors import CairnError
from libs.common.settings import load
from libs.common.states import Workers
from services.worker import firewall, hardening, state
from services.worker.cgroups import AttemptCgroup
from services.worker.isolation import Identity, kill_every_process_of
from services.worker.settings import WorkerSettings

log = logging.getLogger("cairn.sidecar")


def _orphans_killed(shared: dict[str, Any]) -> None:
    """Kill every process the agent's attempts left: their cgroups, their uids, and the
    process groups of those that run as the agent's own uid (no uid of their own).

    A group is not killed by its id alone: a leader its spawn helper reaped stays on the
    board until the agent hears of its exit, and by then its pid may lead another
    process's group (pids wrap at ``pid_max``, 32,768 by default, and every PostgreSQL
    backend leads a group of its own): only the group's processes of the agent's uid
    are killed. An attempt with a uid of its own is reached, all of it, through its uid
    (no_new_privs: none of its processes runs as another)."""
    attempts: dict[str, int] = shared.get("attempts", {})
    uids: dict[str, int] = shared.get("uids", {})
    _groups_killed({pid for attempt, pid in attempts.items() if pid > 0 and attempt not in uids})
    for folders in shared.get("cgroups", {}).values():
        for folder in folders[:1]:
            AttemptCgroup("v1", {"": Path(folder)}).kill_all()
    for uid in uids.values():
        kill_every_process_of(Identity(int(uid), int(uid)))


def _groups_killed(groups: set[int]) -> None:
    """SIGKILL the processes of these process groups that run as this process's uid."""
    if not groups:
        return
    mine = os.geteuid()
    for pid in procs.group_members(groups):
        if procs.effective_uid(pid) == mine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def hung_after(hang_s: float) -> float:
    """How long the agent's pulse may stop before the sidecar takes it for hung: half of
    core's bound, so its attempts are killed here before core re-places them (core sees
    the hang later: its stored turn time lags by up to a keep-alive and a freshness)."""
    return hang_s / 2


def watch_every(interval_s: float, hang_s: float) -> float:
    """How often the sidecar reads the agent's pulse: a small share of the hang bound."""
    return min(interval_s, hang_s / 32)


class Pulse:
    """The agent's pulse as the sidecar reads it (``state.Board.pulse_at``)."""

    def __init__(self, board: state.Board, hang_s: float) -> None:
        self.board = board
        self.after_s = hung_after(hang_s)
        self.since = time.monotonic()  # the newest mark seen; before any, this start

    def still_for(self) -> float:
        """How long the agent's loop has stood still (a read that finds no mark, or a torn
        one, keeps the newest seen)."""
        self.since = max(self.since, self.board.pulse_at() or 0.0)
        return time.monotonic() - self.since

    def hung(self) -> float | None:
        """How long the loop has stood still, once that is past the bound; else None."""
        still = self.still_for()
        return still if still > self.after_s else None


async def beat_forever(
    folder: Path,
    board: state.Board,
    worker_id: int,
    interval_s: float,
    timeout_s: float,
    client: CoreClient,
    hang_s: float = math.inf,
    home: Path | None = None,
) -> None:
    """Beat until the agent is gone, or hung (``Pulse``). Cut off from core for nearly
    ``timeout_s``, after which core re-places this worker's attempts, it kills them here,
    so they never run twice."""
    loop = asyncio.get_running_loop()
    last_ok = next_beat = loop.time()
    gone = _watch(os.getppid())
    pulse = Pulse(board, hang_s)
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
        still = pulse.hung()
        if still is not None:
            every = watch_every(interval_s, hang_s)
            await _hung(folder, board, worker_id, client, still, gone, every)
            return
        if loop.time() >= next_beat:
            seen = shared.get("seen")
            if await _beat(folder, worker_id, attempts, client, board.hung(), seen):
                last_ok = loop.time()
            elif loop.time() - last_ok > max(timeout_s - interval_s, interval_s):
                log.error("cut off from core too long: stopping this worker's attempts")
                _orphans_killed(shared)
            next_beat = loop.time() + interval_s
        pause = min(watch_every(interval_s, hang_s), next_beat - loop.time())
        await waits.woken(gone, max(0.0, pause))


async def _beat(
    folder: Path,
    worker_id: int,
    attempts: dict[str, int],
    client: CoreClient,
    hung: state.Hung = (0, 0),
    seen: int | None = None,
) -> bool:
    """One heartbeat, its answer left for the agent; whether core answered. ``hung``:
    what of the agent hangs on sources that did not answer, for core's gauges;
    ``seen``: the highest attempt id the agent had been handed when it wrote the board
    this list was read from (``Heartbeat.seen``).

    It names every attempt on the board, whatever its process does: the living agent
    holds each until core has its report (the agent dead or hung, this sidecar stops
    beating). A process that has exited is still the agent's to report: it is reaped
    (by its spawn helper) before the agent hears of it and takes its pid off the board,
    and a beat that left it out then would have core lose an attempt that ended well,
    spend it, and refuse its report."""
    try:
        alive = [int(a) for a in attempts]
        answer = await client.heartbeat(worker_id, alive, hung=hung, seen=seen)
    except (httpx.TransportError, CairnError) as exc:
        log.warning("heartbeat failed: %s", exc)
        return False
    state.write(folder / state.ANSWER, answer.model_dump())
    return True


async def _hung(
    folder: Path,
    board: state.Board,
    worker_id: int,
    client: CoreClient,
    still_s: float,
    gone: asyncio.Event,
    every_s: float,
) -> None:
    """The agent lives but its loop stands still: kill its attempts (its hard timeouts
    live in that loop), tell core they are lost and the worker dead, and beat no more.
    Should the agent wake, it reads that it is dead and joins afresh; until it exits,
    nothing it left runs on."""
    log.error(
        "the agent's loop has stood still for %.1f s: killing its attempts; worker %s is dead",
        still_s,
        worker_id,
    )
    _orphans_killed(board.read())
    state.write(folder / state.ANSWER, {"state": Workers.DEAD, "stop": []})
    try:
        await client.heartbeat(worker_id, [], hung_s=round(still_s, 3))
    except (httpx.TransportError, CairnError) as exc:
        # Unheard, core still buries the worker: no more beats, and no turns.
        log.warning("could not tell core that the agent hung: %s", exc)
    # Until the agent stops this sidecar (it woke, saw it is dead) or exits, whatever it
    # starts meanwhile is stopped too: core re-places this worker's attempts.
    while not gone.is_set():
        await waits.woken(gone, every_s)
        _orphans_killed(board.read())


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
    parser.add_argument("--hang-s", type=float, default=math.inf, help="core's hang bound")
    args = parser.parse_args(argv)
    settings = load(WorkerSettings, "cairn worker sidecar")
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
                args.hang_s,
                settings.home,
            )

    # SIGTERM (the agent stopping it) ends it at once: it holds nothing to flush. Raised
    # as SystemExit inside the loop instead, the loop's shutdown waited for its tasks to
    # end and once never returned: a sidecar left sleeping after its agent and its test
    # had gone (a fresh-clone CI run, 2026-12-07).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
