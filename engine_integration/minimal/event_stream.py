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


def hold_back(text: str, stops: tuple[str, ...]) -> str:
    """``text`` without what may still change or vanish: a trailing U+FFFD (the decoded text
    of a character whose bytes span tokens, until its last byte arrives; sent as it was, the
    text that follows would no longer continue what was sent) and its longest tail that is a
    proper prefix of a stop string."""
    text = text.rstrip("\ufffd")
    if not text:
        return text
    keep, last = len(text), text[-1]
    for stop in stops:  # candidate tails end where the stop string holds the last character
        end = min(len(stop) - 1, len(text))
        while (i := stop.rfind(last, 0, end)) >= 0:
            if text.endswith(stop[: i + 1]):
                keep = min(keep, len(text) - i - 1)
                break
            end = i
    return text[:keep]


DONE = "data: [DONE]\n\n"  # the last event of an OpenAI stream


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
