"""The sidecar: a process beside the agent that tells core, every heartbeat interval, that
the worker lives and which attempts' processes it sees alive. When the agent is gone it
stops beating (so core declares the worker dead) and kills the attempts left behind."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import httpx

from libs.common import logs
from libs.common.client import CoreClient
from libs.common.errors import CairnError
from services.worker import state
from services.worker.settings import WorkerSettings

log = logging.getLogger("cairn.sidecar")


def _orphans_killed(attempts: dict[str, int]) -> None:
    for pid in filter(None, attempts.values()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


async def beat_forever(
    folder: Path, worker_id: int, interval_s: float, timeout_s: float, client: CoreClient
) -> None:
    """Beat until the agent is gone. Cut off from core for nearly ``timeout_s``, after which
    core re-places this worker's attempts, it kills them here, so they never run twice."""
    loop = asyncio.get_running_loop()
    last_ok = loop.time()
    while True:
        shared = state.read(folder / state.ATTEMPTS)
        agent = int(shared.get("agent_pid", 0))
        attempts: dict[str, int] = shared.get("attempts", {})
        if not agent or not state.alive(agent):
            log.warning(
                "the agent (pid %s) is gone; stopping its attempts and the heartbeat", agent
            )
            _orphans_killed(attempts)
            return
        # pid 0: claimed and being prepared by the (living) agent.
        living = [int(a) for a, pid in attempts.items() if pid == 0 or state.alive(pid)]
        try:
            answer = await client.heartbeat(worker_id, living)
            state.write(folder / state.ANSWER, answer.model_dump())
            last_ok = loop.time()
        except (httpx.TransportError, CairnError) as exc:
            log.warning("heartbeat failed: %s", exc)
            if loop.time() - last_ok > max(timeout_s - interval_s, interval_s):
                log.error("cut off from core too long: stopping this worker's attempts")
                _orphans_killed(attempts)
        await asyncio.sleep(interval_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cairn-sidecar", description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("worker_id", type=int)
    parser.add_argument("interval_s", type=float)
    parser.add_argument("timeout_s", type=float)
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    logs.setup("sidecar", settings.log_level)

    async def run() -> None:
        async with CoreClient(settings.url, settings.token) as client:
            await beat_forever(args.folder, args.worker_id, args.interval_s, args.timeout_s, client)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
