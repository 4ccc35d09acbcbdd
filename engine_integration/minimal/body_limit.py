"""An ASGI middleware that bounds request bodies: one above a size gets HTTP 413, the
bodies of the requests being handled at once share a budget (more get HTTP 503), and a
body must arrive within a time (else HTTP 408).

A declared Content-Length above the limit is refused before any byte is read. Every body
is read here, up to the limit (one sent without a length, chunked, is refused once it
passes it), taking its bytes of the budget as they arrive (a connection that sends
headers and no body holds none), then handed to the app; a request holds them until its
response ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .openai_protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int,
                 budget: int, timeout: float):
        self.app = app
        self.limit = limit
        self.budget = budget  # bytes of the bodies of all requests being handled
        self.timeout = timeout  # seconds a request's whole body may take to arrive
        self.held = 0  # (one event loop: no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and not declared.isdigit():  # the server answers 400
            await self.app(scope, receive, send)
            return
        if declared is not None and int(declared) > self.limit:
            await self._too_large(send)
            return
        body = bytearray()
        taken = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    await refuse(send, 408, f"the request body did not arrive within "
                                 f"{self.timeout:g} s (engine serve --request-body-timeout)")
                    return
                if message["type"] != "http.request":
                    return  # the client went away
                piece = message.get("body", b"")
                if len(body) + len(piece) > self.limit:
                    await self._too_large(send)
                    return
                if not self._take(len(piece)):
                    await self._busy(send)
                    return
                taken += len(piece)
                body += piece
                if not message.get("more_body", False):
                    break
            whole = bytes(body)
            del body  # (one copy held while the app runs)
            await self.app(scope, self._replay(whole, receive), send)
        finally:
            self.held -= taken

    def _take(self, n: int) -> bool:
        if n and self.held + n > self.budget:
            return False
        self.held += n
        return True

    async def _too_large(self, send: Send) -> None:
        await refuse(send, 413, f"the request body is larger than the server accepts "
                     f"({self.limit} bytes; engine serve --max-request-body)")

    async def _busy(self, send: Send) -> None:
        await refuse(send, 503, f"the server is handling {self.held} bytes of request bodies "
                     f"and accepts {self.budget} at once (engine serve --max-request-bodies); "
                     "try again")

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # later calls wait for the client's disconnect
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay


async def refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
