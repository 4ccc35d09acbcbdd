"""Server-sent events: the streaming response and the text it carries."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStream(StreamingResponse):
    """A StreamingResponse that closes its iterator however the response ends, so that a
    client going away aborts its request at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


DONE = "data: [DONE]\n\n"  # the last event of an OpenAI stream


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
