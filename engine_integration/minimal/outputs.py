"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # all generated so far, or with OutputKind.DELTA only what is new since the last output
    output_token_ids: list[int]
    text: str  # the same for the text (stop strings cut off)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    num_external_tokens: int = 0  # prompt tokens after those, loaded from lmkv
    num_output_tokens: int = 0  # tokens generated so far (whatever the output kind)


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
