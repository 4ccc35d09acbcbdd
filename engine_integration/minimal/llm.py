"""The offline API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from lmkv.config import LMKVConfig

_CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    def __init__(self, model: str | None = None, lmkv_config: LMKVConfig | None = None,
                 **engine_args):
        unknown = set(engine_args) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), lmkv_config=lmkv_config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, batched; outputs in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # only the finished outputs are returned: the engine builds no others
        params = [replace(p, output_kind=OutputKind.FINAL_ONLY) for p in params]
        order: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:  # a bad prompt or a failed step leaves none of these requests behind
            for prompt, p in zip(prompts, params, strict=True):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                order.append(rid)
            while len(done) < len(order):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        done[out.request_id] = out
            while self.engine.has_unfinished_requests():  # lmkv quality-gate re-runs (no output)
                self.engine.step()
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return [done[r] for r in order]

    def precompute(self, documents, batch_size: int = 8, progress: bool = True):
        """Compute and store the KV of RAG document chunks (text or token ids) so that later
        prompts built from them blend it in. Needs lmkv; idempotent."""
        from lmkv.blend.precompute import precompute

        if self.engine.kv_connector is None:
            raise ValueError("precompute needs lmkv: pass lmkv_config")
        return precompute(self.engine, self.engine.kv_connector.cache, documents, batch_size,
                          progress)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
