"""Runs one scheduled step: builds the flattened batch, runs the model, samples."""

from __future__ import annotations

import torch

from .attention_metadata import AttentionMetadata
from .model import LayerHooks, LlamaForCausalLM
from .sampler import sample
from .scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int):
        self.model = model
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.num_forward_tokens = 0  # tokens the model computed, over the engine's life

    def execute(
        self, sched: SchedulerOutput, hooks: LayerHooks | None = None
    ) -> dict[str, int]:
        """Compute the scheduled tokens; returns request_id -> sampled token for each
        request whose known tokens are all computed after this step."""
        # decodes (one query token) first: the attention metadata expects that order
        batch = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, hooks)
        self.num_forward_tokens += input_ids.shape[0]
        if not sample_rows:
            return {}
        rows, reqs = zip(*sample_rows, strict=True)
        logits = self.model.compute_logits(hidden[list(rows)])
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        sample_rows = []
        max_blocks = max(len(s.request.block_ids) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int64)
        for i, s in enumerate(batch):
            req = s.request
            lo = req.num_computed_tokens
            hi = lo + s.num_new_tokens
            ids.extend(req.all_token_ids[lo:hi])
            pos.extend(range(lo, hi))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(lo, hi))
            seq_lens.append(hi)
            starts.append(starts[-1] + s.num_new_tokens)
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
            if hi == req.num_tokens:
                sample_rows.append((starts[-1] - 1, req))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int64),
            num_decodes=sum(1 for s in batch if s.num_new_tokens == 1),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta, sample_rows
