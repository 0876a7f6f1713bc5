"""A real webhook receiver on 127.0.0.1 for the notification tests: it records every
request, can fail the first tries of each delivery, and can hold a request open."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from services.core.domain.notify import verify


@dataclass(frozen=True)
class Received:
    delivery_id: str
    headers: dict[str, str]
    body: bytes
    answered: int

    @property
    def doc(self) -> Any:
        return json.loads(self.body)

    def signed_by(self, secret: str) -> bool:
        stamp = self.headers.get("x-cairn-timestamp", "")
        return verify(secret, self.body, stamp, self.headers.get("x-cairn-signature", ""))


class Receiver:
    """Answers ``status`` to the first ``fail_first`` tries of each delivery id, then 200
    (``fail_first=None``: always ``status``). With ``hold`` set, the first request waits
    until ``release`` is called (and answers nothing if its sender is gone by then)."""

    def __init__(self, fail_first: int | None = 0, status: int = 500, hold: bool = False):
        self.fail_first = fail_first
        self.status = status
        self.received: list[Received] = []
        self.held = threading.Event()
        self._release = threading.Event()
        if not hold:
            self._release.set()
        self._lock = threading.Lock()
        self._tries: Counter[str] = Counter()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def accepted(self) -> list[Received]:
        """The requests answered 2xx."""
        with self._lock:
            return [r for r in self.received if 200 <= r.answered < 300]

    def all(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def _hold_this(self) -> bool:
        """Whether to hold this request: the first one only, until ``release``."""
        with self._lock:
            if self._release.is_set() or self.held.is_set():
                return False
            self.held.set()
            return True

    def _answer(self, delivery_id: str) -> int:
        with self._lock:
            self._tries[delivery_id] += 1
            tries = self._tries[delivery_id]
        if self.fail_first is None or tries <= self.fail_first:
            return self.status
        return 200

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                delivery_id = self.headers.get("X-Cairn-Delivery", "")
                if receiver._hold_this():
                    receiver._release.wait(60)
                status = receiver._answer(delivery_id)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    receiver.received.append(Received(delivery_id, headers, body, status))
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the sender is gone

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def subscribe(client: httpx.Client, url: str, **fields: Any) -> dict[str, Any]:
    body = {"name": "hook", "events": ["task.dead"], "url": url, **fields}
    answer = client.post("/v1/subscriptions", json=body)
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    return made
