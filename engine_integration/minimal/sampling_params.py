"""How to pick the next tokens of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# each generated piece of text is matched against every stop string (and the stream holds back
# what could still become one), so their number and length are bounded; OpenAI's API takes 4
MAX_STOPS, MAX_STOP_CHARS = 16, 1024
MAX_STOP_TOKEN_IDS = 256  # each generated token is looked up in them


class OutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's RequestOutputKind): after every step everything
    so far (CUMULATIVE: O(length) per step), only what is new since the last output (DELTA:
    text held back while it may still become a stop string), or one output when finished
    (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the text ends with the stop string it met
    output_kind: OutputKind = OutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        _check(self.temperature >= 0, "temperature", ">= 0")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "-1, 0 or a positive integer")
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        _check(isinstance(self.output_kind, OutputKind), "output_kind", "an OutputKind")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        _check(len(self.stop) <= MAX_STOPS and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
               f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, want: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}: must be {want}")
