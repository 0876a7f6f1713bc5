"""Turn wire benchmark: the agent's HTTP turn against the same turn over a WebSocket.

    .venv/bin/python bench/turn_wire.py [--turns 300] [--sizes 1,4,32] [--rounds 2]
        [--port 23100] [--rate 200] [--latency-s 10] [--run-ms 5] [--deflate] [--json F]

A fresh embedded PostgreSQL (durable settings) and one core process: core's own app
(``services.core.app.create_app``, its loops, pools and settings, served as
``python -m services.core`` serves it) with one route added for this benchmark only,
``/v1/workers/{id}/wire``: a WebSocket on which each text frame is a ``Turn`` and each
answer a ``TurnAnswer``, both the JSON the HTTP turn carries. Each frame is served as
``POST /v1/workers/{id}/turn`` serves a request (the caller from the token cache, the
worker's lease, ``ops.dispatch.turn`` unchanged); only the transport differs.

**CPU a turn.** One worker, in this process, turns in a closed loop: each turn reports
the ``k`` attempts the turn before leased (``succeeded``) and claims ``k`` more (with a
claim wait, as the agent's claims carry; work is always there, so none waits), for
``--turns`` turns a phase, ``k`` in ``--sizes``. The HTTP side is the agent's client
(``libs.common.client.CoreClient.turn``: httpx, its default settings, the lease header);
**raw** is the same HTTP request on a lean HTTP/1.1 client (``bench/rawhttp.py``: one
keep-alive connection, tens of microseconds a request), which tells httpx's share from
HTTP's; the WebSocket side (**ws**) is ``websockets``' asyncio client on one connection
(no compression unless ``--deflate``). Phases go http, raw, ws, ws, raw, http for each
size (reversed in odd rounds), ``--rounds`` times. Each phase's tasks are submitted
before it, outside its window. Printed per phase and per side: CPU a turn of this
process (the client), of core and of PostgreSQL (all its processes), from ``/proc``;
and core's net of what it spends idle (measured before the first task, per second,
times the phase's length: core's loops run whether or not turns come, and a faster
side's phase is shorter).

**Created → leased.** ``--latency-s`` seconds of single submissions at ``--rate`` a
second (open loop), while one worker turns as the agent does: a claim that waits at core
for work; after a claim that waited and leased, the next claim goes once the first of
those attempts has ended (``--run-ms`` after its lease, at most 30 ms: the agent's
``_hold_claim``), carrying its report; after one that leased at once, at once. Each task's
created → leased comes from the database, split by whether the claim that leased it had
waited at core for it (a task that found no claim waiting waits for the next turn). Then
the same with leases pushed (``/v1/workers/{id}/push``, this benchmark's only too): the
claim stands at core, which claims again as soon as a claim leased and sends what it
leased; reports go as each attempt ends, in turns of their own (those that end while
one is on its way go together in the next). http, raw, ws and push once a round each,
with the CPU a task of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx
import psycopg
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fleet import pg_cpu_s
from procstat import cpu_s
from rawhttp import Conn, request_bytes
from stack import core_stack, exit_on_sigterm

from libs.common.client import CoreClient, _unset_of
from libs.common.models import (
    WORKER_LEASE_HEADER,
    AttemptReport,
    ClaimRequest,
    TaskCreate,
    Turn,
    TurnAnswer,
    WorkerRegister,
)
from libs.common.settings import libpq_url
from services.core import admin

WIRE = "/v1/workers/{worker_id}/wire"
PUSH = "/v1/workers/{worker_id}/push"
SPEC = {
    "name": "noop",
    "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64},
    "resources": {"cpu": 0.01, "memory_mb": 1},
}
#: the agent's claim wait at the default heartbeat settings (``agent.claim_wait``)
CLAIM_WAIT_S = 20.0
#: how long the agent holds its next claim for the first report (``agent.HOLD_MAX_S``)
HOLD_MAX_S = 0.03
IDLE_S = 3.0

Turner = Callable[[Turn], Awaitable[TurnAnswer]]


# --- the core process: core's app and the benchmark's WebSocket route -------------------


def serve() -> None:
    """Core as ``python -m services.core`` runs it, plus ``WIRE`` (this benchmark's only)."""
    from pydantic import ValidationError
    from starlette.websockets import WebSocketState

    from libs.common import serve as service
    from libs.common.errors import CairnError
    from services.core import migrate
    from services.core.api.deps import engine_of, plain_caller
    from services.core.api.workers import AGENTS, _dispatcher_on, _hold
    from services.core.app import create_app
    from services.core.ops import dispatch as ops
    from services.core.settings import CoreSettings

    async def opened(websocket: WebSocket, worker_id: int) -> Any:
        """The connection accepted if its caller may act for the worker, else refused."""
        lease = websocket.headers.get(WORKER_LEASE_HEADER)
        request: Any = websocket  # an HTTPConnection: what the helpers read of a request
        try:
            await _hold(
                worker_id, await plain_caller(request, AGENTS), engine_of(request), request, lease
            )
        except CairnError:
            await websocket.close(code=1008)
            return None
        await websocket.accept()
        return request

    async def served(request: Any, worker_id: int, body: Turn) -> str:
        """One turn, served as ``POST /v1/workers/{id}/turn`` serves a request's body: the
        caller (token cache), the worker's lease (lease cache), ``ops.dispatch.turn``."""
        websocket: WebSocket = request

        async def gone() -> bool:
            return websocket.client_state == WebSocketState.DISCONNECTED

        lease = websocket.headers.get(WORKER_LEASE_HEADER)
        principal = await plain_caller(request, AGENTS)
        engine = engine_of(request)
        worker = await _hold(worker_id, principal, engine, request, lease)
        dispatcher = _dispatcher_on(request, engine)
        done = await ops.turn(dispatcher, worker.id, body, websocket.headers, gone)
        answer = TurnAnswer(
            state=done.state, reports=done.reports, attempts=done.attempts, waited=done.waited
        )
        return answer.model_dump_json()

    # FastAPI reads the routes' parameters' annotations from this module's names.
    async def wire(websocket: WebSocket, worker_id: int) -> None:
        """A turn a frame, each answered in turn."""
        request = await opened(websocket, worker_id)
        if request is None:
            return
        try:
            while True:
                body = Turn.model_validate_json(await websocket.receive_text())
                await websocket.send_text(await served(request, worker_id, body))
        except WebSocketDisconnect:
            return
        except (ValidationError, CairnError):
            await websocket.close(code=1008)

    async def push(websocket: WebSocket, worker_id: int) -> None:
        """A frame with a claim makes it the connection's standing claim: core claims with
        it again as soon as a claim of it leased (or its wait ended) and pushes what it
        leased. A frame without a claim (reports) is a turn, answered."""
        request = await opened(websocket, worker_id)
        if request is None:
            return
        sending = asyncio.Lock()
        standing: asyncio.Task[None] | None = None

        async def send(text: str) -> None:
            async with sending:
                await websocket.send_text(text)

        async def claims(claim: Turn) -> None:
            while True:
                answer = await served(request, worker_id, claim)
                if '"attempts":[]' not in answer:
                    await send(answer)

        try:
            while True:
                body = Turn.model_validate_json(await websocket.receive_text())
                if body.claim is not None:
                    if standing is not None:
                        standing.cancel()
                    standing = asyncio.create_task(claims(Turn(claim=body.claim)))
                    body = Turn(reports=body.reports, started=body.started)
                if body.reports or body.started:
                    await send(await served(request, worker_id, body))
        except WebSocketDisconnect:
            return
        except (ValidationError, CairnError):
            await websocket.close(code=1008)
        finally:
            if standing is not None:
                standing.cancel()

    def create(settings: CoreSettings, url: str) -> FastAPI:
        app = create_app(settings, url)
        for path, route in ((WIRE, wire), (PUSH, push)):
            app.add_api_websocket_route(path, route)
            # first: ahead of the routes that match any path (the dashboard's)
            app.router.routes.insert(0, app.router.routes.pop())
        return app

    service.main(
        name="core",
        description=__doc__,
        settings_class=CoreSettings,
        create_app=create,
        upgrade=migrate.upgrade,
        argv=[],
        graceful_s=5,
        freeze=True,
    )


# --- the two clients ---------------------------------------------------------------------


def http_turner(client: CoreClient, worker_id: int) -> Turner:
    async def turn(body: Turn) -> TurnAnswer:
        return await client.turn(worker_id, body)

    return turn


def raw_turner(url: str, worker_id: int, token: str, lease: str) -> Turner:
    """The same request as ``http_turner``'s on a lean HTTP/1.1 client (``rawhttp``), on
    one keep-alive connection, opened again when core closed it (idle between phases)."""
    where = httpx.URL(url)
    host, port = where.host, where.port or 80
    path = f"/v1/workers/{worker_id}/turn"
    headers = {WORKER_LEASE_HEADER: lease}
    conns: list[Conn] = []

    async def turn(body: Turn) -> TurnAnswer:
        if not conns or conns[0].closed:
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(lambda: Conn(loop), host, port)
            conns[:] = [conn]
        content = body.model_dump_json(exclude=_unset_of(body)).encode()
        data = request_bytes(host, port, path, content, token, headers)
        status, answer = await conns[0].request(data, 30.0)
        if status != 200:
            raise SystemExit(f"turn answered {status}: {answer[:200]!r}")
        return TurnAnswer.model_validate_json(answer)

    return turn


def ws_turner(ws: Any) -> Turner:
    async def turn(body: Turn) -> TurnAnswer:
        await ws.send(body.model_dump_json(exclude=_unset_of(body)))
        return TurnAnswer.model_validate_json(await ws.recv())

    return turn


def report(attempt_id: int) -> AttemptReport:
    """What the agent reports of a ``/bin/true`` attempt."""
    return AttemptReport(
        attempt_id=attempt_id,
        outcome="succeeded",
        exit_code=0,
        peak_memory_mb=1.2,
        cpu_seconds=0.0007,
    )


def room(k: int, wait: float = CLAIM_WAIT_S) -> ClaimRequest:
    return ClaimRequest(cpu=4000, memory_mb=10_000_000, max=k, wait=wait, ahead_s=3.0)


async def submit(core: CoreClient, count: int) -> None:
    spec = TaskCreate.model_validate(SPEC)
    for start in range(0, count, 1000):
        await core.submit_batch([spec] * min(1000, count - start))


async def turn_phase(
    turn: Turner, core: CoreClient, k: int, turns: int, pids: tuple[int, int]
) -> dict[str, float]:
    """``turns`` turns of ``k`` reports and a claim of ``k``; CPU of each side a turn."""
    await submit(core, k * (turns + 1))
    answer = await turn(Turn(claim=room(k)))  # outside the window: leases the first k
    await asyncio.sleep(0.3)
    core_pid, postmaster = pids
    began, client0 = time.perf_counter(), time.process_time()
    core0, pg0 = cpu_s(core_pid), pg_cpu_s(postmaster)
    for _ in range(turns):
        reports = [report(a.attempt_id) for a in answer.attempts]
        answer = await turn(Turn(reports=reports, claim=room(k)))
        if len(answer.attempts) != k or any(v.status != 200 for v in answer.reports):
            raise SystemExit(f"turn leased {len(answer.attempts)} of {k}: {answer.reports[:2]}")
    wall = time.perf_counter() - began
    client = time.process_time() - client0
    core_s, pg_s = cpu_s(core_pid) - core0, pg_cpu_s(postmaster) - pg0
    await turn(Turn(reports=[report(a.attempt_id) for a in answer.attempts]))
    return {"wall_s": wall, "client_s": client, "core_s": core_s, "pg_s": pg_s}


async def idle_core(core_pid: int) -> float:
    """Core's CPU a second with no turns (its loops). PostgreSQL's is left out: after the
    phases' drains its autovacuum makes it mostly noise."""
    core0 = cpu_s(core_pid)
    await asyncio.sleep(IDLE_S)
    return (cpu_s(core_pid) - core0) / IDLE_S


# --- created -> leased: claims as the agent sends them, or leases pushed ----------------


async def agent_claims(
    turn: Turner, args: argparse.Namespace, more: Callable[[int], bool]
) -> dict[int, bool]:
    """Turns as the agent takes them until ``more()`` is false: each attempt leased, and
    whether the claim that leased it had waited at core."""
    loop = asyncio.get_running_loop()
    ended: list[AttemptReport] = []
    first_end = asyncio.Event()
    waited: dict[int, bool] = {}

    def end(attempt_id: int) -> None:
        ended.append(report(attempt_id))
        first_end.set()

    while more(len(waited)):
        reports, ended[:] = list(ended), []
        answer = await turn(Turn(reports=reports, claim=room(64, wait=0.5)))
        for a in answer.attempts:
            waited[a.attempt_id] = answer.waited
            loop.call_later(args.run_ms / 1000, end, a.attempt_id)
        if answer.attempts and answer.waited:
            first_end.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(first_end.wait(), HOLD_MAX_S)
    await asyncio.sleep(args.run_ms / 1000 + 0.01)
    await turn(Turn(reports=list(ended)))
    return waited


async def pushed_leases(
    ws: Any, args: argparse.Namespace, more: Callable[[int], bool]
) -> dict[int, bool]:
    """On ``PUSH``: one claim that stands (core claims again after each lease and pushes
    what it leased), each report streamed as its attempt ends (those that end while one
    is on its way go together in the next)."""
    loop = asyncio.get_running_loop()
    ended: list[AttemptReport] = []
    leased: dict[int, bool] = {}
    reporting = False
    unreported = 0
    sends: set[asyncio.Future[None]] = set()

    def send_reports() -> None:
        nonlocal reporting
        reporting = True
        body = Turn(reports=list(ended))
        ended.clear()
        sent = asyncio.ensure_future(ws.send(body.model_dump_json(exclude=_unset_of(body))))
        sends.add(sent)
        sent.add_done_callback(sends.discard)

    def end(attempt_id: int) -> None:
        ended.append(report(attempt_id))
        if not reporting:
            send_reports()

    await ws.send(Turn(claim=room(64, wait=0.5)).model_dump_json(exclude={"progress", "holding"}))
    while more(len(leased)) or unreported or ended or reporting:
        answer = TurnAnswer.model_validate_json(await ws.recv())
        for a in answer.attempts:
            leased[a.attempt_id] = True
            unreported += 1
            loop.call_later(args.run_ms / 1000, end, a.attempt_id)
        if answer.reports:
            unreported -= len(answer.reports)
            reporting = False
            if ended:
                send_reports()
    return leased


async def latency_phase(
    drive: Callable[[Callable[[int], bool]], Awaitable[dict[int, bool]]],
    submitter: CoreClient,
    stack: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``--latency-s`` of single submissions at ``--rate`` while ``drive`` leases them;
    created -> leased of each task from the database, and the CPU a task."""
    loop = asyncio.get_running_loop()
    spec = TaskCreate.model_validate(SPEC)
    ids: list[int] = []
    sent: set[asyncio.Task[Any]] = set()
    total = int(args.rate * args.latency_s)

    async def one() -> None:
        task, _ = await submitter.submit(spec)
        ids.append(task.id)

    async def submit_open_loop() -> None:
        start = loop.time()
        for i in range(total):
            await asyncio.sleep(max(0.0, start + i / args.rate - loop.time()))
            job = asyncio.create_task(one())
            sent.add(job)
            job.add_done_callback(sent.discard)
        while sent:
            await asyncio.wait(set(sent))

    client0, core0, pg0 = time.process_time(), cpu_s(stack.core_pid), pg_cpu_s(stack.postmaster_pid)
    feeder = asyncio.create_task(submit_open_loop())
    got = await drive(lambda leased: not feeder.done() or leased < total)
    await feeder
    cpu = {
        "client": time.process_time() - client0,
        "core": cpu_s(stack.core_pid) - core0,
        "pg": pg_cpu_s(stack.postmaster_pid) - pg0,
    }
    with psycopg.connect(libpq_url(stack.database_url)) as db:
        rows = db.execute(
            "SELECT a.id, extract(epoch FROM a.started_at - t.created_at) * 1000"
            " FROM core.tasks t JOIN core.attempts a ON a.task_id = t.id AND a.number = 1"
            " WHERE t.id = ANY(%s)",
            (ids,),
        ).fetchall()
    found = split([(got[a], float(ms)) for a, ms in rows if a in got])
    # the client's CPU includes the submitter's (the same on every side)
    found["cpu_ms_per_task"] = {k: v * 1000 / max(len(ids), 1) for k, v in cpu.items()}
    return found


def split(found: list[tuple[bool, float]]) -> dict[str, Any]:
    """created -> leased of all tasks and of each group (a claim waited for it, or not),
    and what leases pushed on arrival would give: every task as the waited-for ones."""

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"n": 0, "p50": float("nan"), "mean": float("nan")}
        return {
            "n": len(values),
            "p50": statistics.median(values),
            "mean": statistics.fmean(values),
        }

    every = stats([ms for _, ms in found])
    hit = stats([ms for w, ms in found if w])
    missed = stats([ms for w, ms in found if not w])
    share = missed["n"] / max(every["n"], 1)
    return {
        "all": every,
        "waiting_claim": hit,
        "next_turn": missed,
        "next_turn_share": share,
        "push_saves_mean_ms": share * (missed["mean"] - hit["mean"]) if missed["n"] else 0.0,
        "push_p50_ms": hit["p50"],
    }


# --- the run -----------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    command = [sys.executable, str(Path(__file__).resolve()), "--serve"]
    env = {"CAIRN_HEARTBEAT_TIMEOUT_S": "600"}
    with core_stack("cairn-bench-wire-", command=command, port=args.port, **env) as stack:
        pids = (stack.core_pid, stack.postmaster_pid)
        user = await asyncio.to_thread(admin.create_token, stack.database_url, "alice", "user")
        token = await asyncio.to_thread(admin.create_token, stack.database_url, "w", "worker")
        timeout = httpx.Timeout(60, connect=5)
        async with (
            CoreClient(stack.core_url, user, timeout=timeout) as core,
            CoreClient(stack.core_url, token) as agent,
        ):
            offer = WorkerRegister(hostname="w", queues=["default"], cpu=4000, memory_mb=10_000_000)
            me = await agent.register_worker(offer)
            headers = {"Authorization": f"Bearer {token}", WORKER_LEASE_HEADER: me.lease}
            url = stack.core_url.replace("http", "ws", 1) + WIRE.format(worker_id=me.worker.id)
            compression = "deflate" if args.deflate else None
            async with websockets.connect(
                url, additional_headers=headers, compression=compression
            ) as ws:
                sides = {
                    "http": http_turner(agent, me.worker.id),
                    "raw": raw_turner(stack.core_url, me.worker.id, token, me.lease),
                    "ws": ws_turner(ws),
                }
                idle = await idle_core(stack.core_pid)  # before any task: no vacuum to come
                for side in sides.values():  # warm each: statements prepared, caches filled
                    await turn_phase(side, core, 4, 30, pids)
                phases: list[dict[str, Any]] = []
                for r in range(args.rounds):
                    for k in args.sizes:
                        names = ["http", "raw", "ws"][:: 1 if r % 2 == 0 else -1]
                        for name in [*names, *reversed(names)]:
                            found = await turn_phase(sides[name], core, k, args.turns, pids)
                            phases.append({"side": name, "k": k, "round": r, **found})
                            print(f"  {name:4} k={k:<3} {per_turn(found, args.turns)}", flush=True)
                latency: dict[str, list[dict[str, Any]]] = {
                    "http": [],
                    "raw": [],
                    "ws": [],
                    "push": [],
                }
                pushing = stack.core_url.replace("http", "ws", 1) + PUSH.format(
                    worker_id=me.worker.id
                )
                for r in range(args.rounds if args.latency_s > 0 else 0):
                    order = ["http", "raw", "ws", "push"][:: 1 if r % 2 == 0 else -1]
                    for name in order:
                        await asyncio.sleep(1.0)
                        if name == "push":
                            async with websockets.connect(
                                pushing, additional_headers=headers, compression=compression
                            ) as pws:
                                drive = functools.partial(pushed_leases, pws, args)
                                found = await latency_phase(drive, core, stack, args)
                        else:
                            drive = functools.partial(agent_claims, sides[name], args)
                            found = await latency_phase(drive, core, stack, args)
                        latency[name].append(found)
                        print(f"  {name:4} {latency_line(found)}", flush=True)
        return {"phases": phases, "core_idle_per_s": idle, "latency": latency}


def latency_line(lat: dict[str, Any]) -> str:
    a, hit, miss = lat["all"], lat["waiting_claim"], lat["next_turn"]
    cpu = lat["cpu_ms_per_task"]
    return (
        f"p50 {a['p50']:.1f} mean {a['mean']:.1f} ms ({a['n']} tasks); a claim waiting:"
        f" {hit['n']}, p50 {hit['p50']:.1f} mean {hit['mean']:.1f}; the next turn:"
        f" {miss['n']} ({lat['next_turn_share']:.0%}), p50 {miss['p50']:.1f} mean"
        f" {miss['mean']:.1f}; CPU a task: client (with the submitter) {cpu['client']:.2f}"
        f" core {cpu['core']:.2f} PostgreSQL {cpu['pg']:.2f} ms"
    )


def per_turn(found: dict[str, float], turns: int) -> str:
    return (
        f"client {found['client_s'] * 1000 / turns:.3f} core {found['core_s'] * 1000 / turns:.3f}"
        f" pg {found['pg_s'] * 1000 / turns:.3f} ms a turn; {turns / found['wall_s']:.0f} turns/s"
    )


def summary(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    idle_core = result["core_idle_per_s"]
    lines = [
        f"core idle: {idle_core * 1000:.1f} ms/s (its loops; before any task)",
        "ms of CPU a turn (sum of phases / turns); core net: minus its idle rate x the time",
        f"{'k':>3} {'side':5} {'client':>7} {'core':>7} {'net':>7} {'pg':>7}"
        f" {'all':>7} {'turns/s':>8}",
    ]
    for k in args.sizes:
        got: dict[str, dict[str, float]] = {}
        for side in ("http", "raw", "ws"):
            mine = [p for p in result["phases"] if p["side"] == side and p["k"] == k]
            turns = args.turns * len(mine)
            wall = sum(p["wall_s"] for p in mine)
            row = {
                "client": sum(p["client_s"] for p in mine) * 1000 / turns,
                "core": sum(p["core_s"] for p in mine) * 1000 / turns,
                "core_net": (sum(p["core_s"] for p in mine) - idle_core * wall) * 1000 / turns,
                "pg": sum(p["pg_s"] for p in mine) * 1000 / turns,
                "rate": turns / wall,
            }
            row["all"] = row["client"] + row["core"] + row["pg"]
            got[side] = row
            lines.append(
                f"{k:>3} {side:5} {row['client']:7.3f} {row['core']:7.3f} {row['core_net']:7.3f}"
                f" {row['pg']:7.3f} {row['all']:7.3f} {row['rate']:8.0f}"
            )
        for side in ("raw", "ws"):
            h, w = got["http"], got[side]
            lines.append(
                f"{k:>3} {side}/http: client {w['client'] / h['client']:.2f}, core"
                f" {w['core'] / h['core']:.2f} (net {w['core_net'] / h['core_net']:.2f}),"
                f" PostgreSQL {w['pg'] / h['pg']:.2f}, all three {w['all'] / h['all']:.2f}"
            )
        result.setdefault("per_turn", {})[k] = got
    for side, runs in result["latency"].items():
        for lat in runs:
            lines.append(f"created -> leased, {side}, {args.rate:g}/s: {latency_line(lat)}")
    return lines


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--sizes", default="1,4,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=23100)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--latency-s", type=float, default=10.0)
    parser.add_argument("--run-ms", type=float, default=5.0)
    parser.add_argument("--deflate", action="store_true", help="permessage-deflate on the ws")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.sizes = [int(k) for k in args.sizes.split(",")]
    exit_on_sigterm()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    result = asyncio.run(run(args))
    for line in summary(result, args):
        print(line)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
