"""An ASGI middleware that refuses request bodies above a size with HTTP 413.

A declared Content-Length above the limit is refused before any byte is read; a body sent
without one (chunked) is read here, up to the limit, and refused once it passes it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .openai_protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than the server accepts ({limit} bytes; "
                         "engine serve --max-request-body)")


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(send, BodyTooLarge(self.limit))
            return
        if declared is not None:
            await self.app(scope, receive, send)  # the server holds the client to its length
            return
        body = bytearray()  # chunked: read it all here, at most limit bytes, then hand it on
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.limit:
                await too_large(send, BodyTooLarge(self.limit))
                return
            if not message.get("more_body", False):
                break
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # later calls wait for the client's disconnect
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def too_large(send: Send, exc: BodyTooLarge) -> None:
    import json

    body = json.dumps(error_body(str(exc), 413)).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
