"""One generation request as the scheduler and model runner see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # tokens [0, num_computed_tokens) have their KV in the paged memory
    num_computed_tokens: int = 0
    # tokens of the prompt whose KV came from the engine's prefix cache at admission
    num_cached_tokens: int = 0
    # tokens after those that lmkv loaded at admission
    num_external_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # appended to; emptied by clear_blocks()
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks so far
    num_registered_blocks: int = 0  # blocks [0, n) offered to the prefix cache already
    _table: torch.Tensor | None = None  # block_ids[:_table_len] as int64 (block_table())
    _table_len: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    output_text: str = ""  # OutputKind.CUMULATIVE: the text so far; once finished: the final text
    stop_window: str = ""  # the text's last characters, where a stop string may still begin
    unsent_text: str = ""  # OutputKind.DELTA: text not in an output yet (held back)
    sent_tokens: int = 0  # OutputKind.DELTA: output tokens already in an output
    sent_chars: int = 0  # OutputKind.DELTA: characters already in an output
    # incremental detokenization: output tokens [detok_prefix, detok_read) are decoded again
    # beside the new ones, for their context (llm_engine._new_text)
    detok_prefix: int = 0
    detok_read: int = 0
    detok_sent: int = 0  # characters past decode(tokens [detok_prefix, detok_read)) given out
    held_text: str = ""  # what the output tokens past the text given out decode to for now
    # False: never register this request's blocks in the prefix cache (quality-gate re-runs)
    cacheable: bool = True
    # mixed into its blocks' prefix-cache hashes: a RAG prompt's blocks live apart, since
    # they may hold blended (approximate) KV (lmkv's SchedulerConnector.prefix_cache_salt)
    prefix_cache_salt: bytes = b""
    # False: use no cached KV (engine prefix cache, lmkv) and save none (quality-gate re-runs)
    use_cache: bool = True
    internal: bool = False  # run for the engine itself (a quality-gate re-run): no output
    blend: Any = None  # lmkv.blend.plan.BlendPlan while a blended prefill is pending
    num_blend_recomputed: int = 0  # tokens with stored KV that blending recomputed
    capture_kv: bool = False  # keep the prompt's KV when its prefill completes (precompute)
    captured_kv: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output as one new list: O(length), not for every step."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, copying only those."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def clear_blocks(self) -> None:
        """The request holds no blocks any more (freed, preempted)."""
        self.block_ids.clear()
        self._table_len = 0
        self.num_registered_blocks = 0

    def block_table(self) -> torch.Tensor:
        """block_ids as an int64 tensor, extended in place as blocks are added (a step copies
        it into the batch's table instead of converting the whole list again)."""
        n = len(self.block_ids)
        if self._table is None or n > self._table.shape[0]:
            grown = torch.empty(max(n, 2 * self._table_len, 16), dtype=torch.int64)
            if self._table is not None:
                grown[: self._table_len] = self._table[: self._table_len]
            self._table = grown
        if n > self._table_len:
            self._table[self._table_len : n] = torch.tensor(self.block_ids[self._table_len :],
                                                            dtype=torch.int64)
            self._table_len = n
        return self._table[:n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
