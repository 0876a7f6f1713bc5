"""What an agent tells core of the services' replicas it runs (docs/services.md):
each one's readiness, its host's address and its ports, sent when a readiness probe
flips; a send that fails goes again (the latest status of each replica), with backoff."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping

import httpx

from libs.common.client import CoreClient
from libs.common.errors import CairnError
from libs.common.models import ReplicaStatus

log = logging.getLogger("cairn.worker.replicas")

MAX_BATCH = 256
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0


def host_address(configured: str | None) -> str:
    """The address other hosts reach this one's replicas at: ``CAIRN_WORKER_ADDRESS``,
    else the one the host name resolves to, else loopback."""
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Replicas:
    """The statuses waiting to go to core, and the one task that sends them."""

    def __init__(self, client: CoreClient, worker_id: Callable[[], int], address: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.address = address
        self.pending: dict[int, ReplicaStatus] = {}
        self.sender: asyncio.Task[None] | None = None

    def tell(self, attempt_id: int, ready: bool, ports: Mapping[str, int], reachable: bool) -> None:
        """Queue the replica's status (``reachable`` false: it lives in a network of its
        own, so it has no address other hosts reach) and make sure it goes."""
        self.pending[attempt_id] = ReplicaStatus(
            attempt_id=attempt_id,
            ready=ready,
            address=self.address if reachable else None,
            ports=dict(ports),
        )
        if self.sender is None or self.sender.done():
            self.sender = asyncio.create_task(self._send())

    def forget(self, attempt_id: int) -> None:
        """The attempt ended: nothing of it goes any more."""
        self.pending.pop(attempt_id, None)

    async def _send(self) -> None:
        delay = RETRY_FIRST_S
        while self.pending:
            batch = list(self.pending.values())[:MAX_BATCH]
            for item in batch:
                del self.pending[item.attempt_id]
            try:
                await self.client.report_replicas(self.worker_id(), batch)
                delay = RETRY_FIRST_S
            except (httpx.TransportError, CairnError) as exc:
                log.warning("replica statuses not sent: %s", exc)
                for item in batch:  # unless a newer one is waiting already
                    self.pending.setdefault(item.attempt_id, item)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
