"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # all generated so far
    text: str  # all generated text so far (stop strings cut off)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    num_external_tokens: int = 0  # prompt tokens after those, loaded from lmkv
