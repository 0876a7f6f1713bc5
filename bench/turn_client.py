"""What a worker agent's turn costs its own process on the HTTP side: the CPU of
``CoreClient.turn`` per call, against a server in another process that answers every
request at once with one canned ``TurnAnswer``, three ways: the agent's client as it is
(httpx on Cairn's lean transport, ``libs/common/transport.py``), the same client on
httpx's own transport (httpcore, h11, anyio), and the same request and answer over a
bare keep-alive connection (``bench/rawhttp.py``); each encodes the same ``Turn`` and
validates the same answer.

    .venv/bin/python bench/turn_client.py [--calls 1000] [--rounds 5] [--leases 3]

Each turn carries ``--leases`` reports and a claim, and its answer as many verdicts and
assignments (about 2 KB at 3). The three clients run in alternate rounds in one process;
the figure of each is its median round, with the load average beside it."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.rawhttp import Conn, request_bytes
from libs.common.client import CoreClient, _unset_of
from libs.common.models import (
    WORKER_LEASE_HEADER,
    AttemptReport,
    ClaimRequest,
    Turn,
    TurnAnswer,
)

#: the server: every request (head, and a body by Content-Length) answered with the
#: bytes given on its stdin, on keep-alive connections
SERVER = r"""
import asyncio, sys
body = sys.stdin.buffer.read()
answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            writer.write(answer)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""
TOKEN = "t" * 43
LEASE = "l" * 43


def answer_of(leases: int) -> bytes:
    assignment = {
        "attempt_number": 1,
        "kind": "task",
        "artifact": {"uri": "file:///srv/jobs/record-start.sh", "sha256": "a" * 64},
        "args": [],
        "env": {"E2E_DIR": "/tmp/e2e-records"},
        "input_path": None,
        "output_path": None,
        "resources": {"cpu": 0.01, "memory_mb": 16},
        "timeout_s": None,
        "charge": {"cpu": 0.01, "memory_mb": 16.0},
        "fencing_token": "1.1.0123456789abcdef",
    }
    answer = {
        "state": "live",
        "reports": [
            {"attempt_id": i, "status": 200, "task_id": i, "state": "succeeded"}
            for i in range(1, leases + 1)
        ],
        "attempts": [
            {**assignment, "attempt_id": 100 + i, "task_id": 100 + i} for i in range(leases)
        ],
    }
    return TurnAnswer.model_validate(answer).model_dump_json().encode()


def turn_of(leases: int) -> Turn:
    reports = [
        AttemptReport(
            attempt_id=i, outcome="succeeded", exit_code=0, peak_memory_mb=1.5, cpu_seconds=0.001
        )
        for i in range(1, leases + 1)
    ]
    claim = ClaimRequest(cpu=0.5, memory_mb=512, max=60, wait=20.0, ahead_s=3.0)
    return Turn(reports=reports, claim=claim)


async def rounds(port: int, args: argparse.Namespace) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    client = CoreClient(f"http://127.0.0.1:{port}", TOKEN)
    client.use_lease(LEASE)
    httpcore_client = CoreClient(
        f"http://127.0.0.1:{port}", TOKEN, transport=httpx.AsyncHTTPTransport()
    )
    httpcore_client.use_lease(LEASE)
    _, conn = await loop.create_connection(lambda: Conn(loop), "127.0.0.1", port)
    path = "/v1/workers/1/turn"

    async def lean() -> None:
        await client.turn(1, turn_of(args.leases))

    async def by_httpcore() -> None:
        await httpcore_client.turn(1, turn_of(args.leases))

    async def bare() -> None:
        body = turn_of(args.leases)
        data = body.model_dump_json(exclude=_unset_of(body, frozenset())).encode()
        head = {WORKER_LEASE_HEADER: LEASE}
        status, content = await conn.request(
            request_bytes("127.0.0.1", port, path, data, TOKEN, head), 30.0
        )
        assert status == 200
        TurnAnswer.model_validate_json(content)

    ways = {"lean": lean, "httpcore": by_httpcore, "bare": bare}
    for way in ways.values():  # warm: connections, validators' first calls
        for _ in range(100):
            await way()
    spent: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            began = time.process_time()
            for _ in range(args.calls):
                await way()
            spent[name].append((time.process_time() - began) / args.calls * 1e6)
    await client.aclose()
    await httpcore_client.aclose()
    conn.transport.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--leases", type=int, default=3)
    args = parser.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(answer_of(args.leases))
    server.stdin.close()
    try:
        port = int(server.stdout.readline())
        spent = asyncio.run(rounds(port, args))
    finally:
        server.terminate()
        server.wait()
    lean_us, httpcore_us, bare_us = (
        statistics.median(spent[name]) for name in ("lean", "httpcore", "bare")
    )
    print(f"load {load}; {args.leases} reports and leases a turn")
    for name in ("lean", "httpcore", "bare"):
        print(f"  {name}: CPU per turn {' '.join(f'{us:.0f}' for us in spent[name])} us")
    print(
        f"CoreClient.turn {lean_us:.0f} us of CPU a turn on the lean transport,"
        f" {httpcore_us:.0f} us on httpx's own, a bare connection {bare_us:.0f} us:"
        f" {lean_us / bare_us:.1f}x and {httpcore_us / bare_us:.1f}x the bare;"
        f" load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
    )


if __name__ == "__main__":
    main()
