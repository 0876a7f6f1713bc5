"""A cap on request bodies, and their coding, checked before anything parses them."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.common.errors import CairnError, HttpStatusError, PayloadTooLarge
from libs.common.problems import PROBLEM_JSON


class BodyLimit:
    """Refuse a body over ``limit`` bytes with 413: at once when Content-Length says so,
    or as soon as a chunked body crosses it. Refuse a coded body (``Content-Encoding``
    other than ``identity``: no service decodes one) with 415 and ``Accept-Encoding:
    identity`` (RFC 9110, 15.5.16): it was read as JSON and refused as malformed (422)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                coding = value.decode("latin-1")[:64]
                await self._refuse(
                    scope,
                    send,
                    HttpStatusError(
                        415,
                        f"Content-Encoding {coding!r} is not taken; send the body as it is"
                        " (identity)",
                        errors=[{"field": "header.Content-Encoding", "reason": "not taken"}],
                    ),
                    [(b"accept-encoding", b"identity")],
                )
                return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.limit:
                    await self._refuse(
                        scope, send, PayloadTooLarge(f"the body is over {self.limit} bytes")
                    )
                    return
                break
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the body is over {self.limit} bytes")
            return message

        await self.app(scope, counted, send)

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        error: CairnError,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        import json

        body = json.dumps(error.problem(instance=scope.get("path"))).encode()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", PROBLEM_JSON.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                    *(headers or []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
