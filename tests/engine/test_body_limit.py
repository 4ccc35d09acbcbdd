"""The request-body bounds of ``engine serve``, on the ASGI middleware itself: one body above
the limit gets 413, and the bodies of the requests handled at once share a budget (503)."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine_integration.minimal.body_limit import BodyLimit
from engine_integration.minimal.server_config import ServerConfig

LIMIT = 1000


class _HeldApp:
    """An app that reads the whole body, then waits until told to answer."""

    def __init__(self):
        self.go = asyncio.Event()
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await self.go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _request(app, body: bytes, declared: bool, pieces: int = 1) -> dict:
    headers = [(b"content-length", str(len(body)).encode())] if declared else []
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    step = -(-len(body) // pieces) or 1
    messages = [{"type": "http.request", "body": body[i : i + step],
                 "more_body": i + step < len(body)} for i in range(0, max(len(body), 1), step)]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client waits for the answer

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": start["status"], "headers": dict(start["headers"]), "body": body_out}


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_bodies_past_the_budget_get_503_until_the_ones_held_are_answered(declared):
    async def run():
        inner = _HeldApp()
        app = BodyLimit(inner, limit=LIMIT, budget=2 * LIMIT, timeout=60)
        held = [asyncio.create_task(_request(app, b"a" * LIMIT, declared, pieces=3))
                for _ in range(2)]
        while len(inner.bodies) < 2:
            await asyncio.sleep(0)
        busy = await _request(app, b"b" * 10, declared)
        assert busy["status"] == 503 and busy["headers"][b"retry-after"] == b"1"
        assert "--max-request-bodies" in json.loads(busy["body"])["error"]["message"]
        empty = asyncio.create_task(_request(app, b"", declared))  # no body: always taken
        while len(inner.bodies) < 3:
            await asyncio.sleep(0)
        inner.go.set()
        assert [(await t)["status"] for t in (*held, empty)] == [200, 200, 200]
        assert app.held == 0
        ok = await _request(app, b"c" * LIMIT, declared, pieces=4)
        assert ok["status"] == 200 and inner.bodies[-1] == b"c" * LIMIT and app.held == 0
        over = await _request(app, b"d" * (LIMIT + 1), declared, pieces=2)
        assert over["status"] == 413 and app.held == 0

    asyncio.run(run())


def test_a_body_that_does_not_arrive_in_time_gets_408_and_holds_nothing():
    """A declared length took its bytes of the budget before any arrived, for as long as
    the connection stayed open: two such requests held this budget whole."""
    async def run():
        inner = _HeldApp()
        app = BodyLimit(inner, limit=LIMIT, budget=2 * LIMIT, timeout=0.2)
        # two requests whose headers declare LIMIT bytes, then nothing
        scope = {"type": "http", "method": "POST", "path": "/",
                 "headers": [(b"content-length", str(LIMIT).encode())]}
        sent: list[dict] = []

        async def never():
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        waiting = [asyncio.create_task(app(scope, never, send)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert app.held == 0  # nothing arrived, nothing taken
        inner.go.set()
        ok = await _request(app, b"c" * LIMIT, True, pieces=2)
        assert ok["status"] == 200
        await asyncio.gather(*waiting)
        statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
        assert statuses == [408, 408] and app.held == 0

    asyncio.run(run())


def test_the_budget_must_hold_one_largest_body():
    with pytest.raises(ValueError, match="max_request_bodies"):
        ServerConfig(max_request_body=8 << 20, max_request_bodies=1 << 20)
    # by default it grows with a larger single-body limit (which alone was valid before)
    assert ServerConfig(max_request_body=512 << 20).request_bodies_budget == 512 << 20
    assert ServerConfig().request_bodies_budget == 256 << 20
