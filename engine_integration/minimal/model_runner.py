"""Runs one scheduled step: builds the flattened batch, runs the model, samples."""

from __future__ import annotations

from typing import Any

import torch

from lmkv import cpu_attention
from lmkv.paged import pinned

from .attention_metadata import AttentionMetadata
from .blend import blend_prefill
from .cuda_graphs import DecodeGraphs
from .model import LayerHooks, LlamaForCausalLM
from .request import Request
from .sampler import sample
from .scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 launcher: Any = None, graphs: DecodeGraphs | None = None):
        self.model = model
        self.graphs = graphs  # CUDA graphs of decode steps (None: every step eager)
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, Hkv, D], on the engine's device
        self.device = kv_cache.device
        self.block_size = block_size
        self.launcher = launcher  # lmkv's kernels' launcher when the device does not say
        self.num_forward_tokens = 0  # tokens the model computed, over the engine's life
        if self.device.type == "cpu" and launcher is None:
            cpu_attention.library()  # decode attention's C, built now (once per machine), not in a request
        elif self.device.type == "cuda" and launcher is None:
            from lmkv.ops import kernel_launcher

            kernel_launcher(kv_cache)  # lmkv's kernels compiled by NVRTC now, not in a request

    def execute(
        self, sched: SchedulerOutput, hooks: LayerHooks | None = None
    ) -> dict[str, int]:
        """Compute the scheduled tokens; returns request_id -> sampled token for each
        request whose known tokens are all computed after this step."""
        blended = [s.request for s in sched.scheduled if s.request.blend is not None]
        # decodes (one query token) first: the attention metadata expects that order
        batch = sorted((s for s in sched.scheduled if s.request.blend is None),
                       key=lambda s: s.num_new_tokens != 1)
        try:
            sampled = {req.request_id: self._blend(req) for req in blended}
        finally:  # one failed: the plans of those after it are given back too
            for req in blended:
                if req.blend is not None:
                    req.blend.release()
                    req.blend = None
        if not batch:
            return sampled
        graphs = self.graphs
        if (graphs is not None and hooks is None and graphs.fits(len(batch))
                and all(s.num_new_tokens == 1 for s in batch)):
            hidden, sample_rows = self._decode_graph(graphs, batch)
        else:
            input_ids, positions, meta, sample_rows = self._prepare(batch)
            hidden = self.model(input_ids, positions, self.kv_cache, meta, hooks)
        self.num_forward_tokens += sum(s.num_new_tokens for s in batch)
        if not sample_rows:
            return sampled
        rows, reqs = zip(*sample_rows, strict=True)
        logits = self.model.compute_logits(self._rows(hidden, rows))
        # the step's host sync: the greedy rows' token ids (and the sampling rows' logits)
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        sampled.update((r.request_id, t) for r, t in zip(reqs, tokens, strict=True))
        return sampled

    def _rows(self, hidden: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
        """``hidden``'s rows ``rows`` (ascending), queued without a host sync: a slice when
        they are consecutive (a decode batch, one prompt), else an index from pinned memory
        (a list index is a pageable copy, which waits for the forward pass queued before it)."""
        if rows[-1] - rows[0] == len(rows) - 1:
            return hidden[rows[0]: rows[-1] + 1]
        index = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            index = pinned(index).to(self.device, non_blocking=True)
        return hidden.index_select(0, index)

    def _decode_graph(self, graphs: DecodeGraphs, batch: list[ScheduledRequest]):
        """A step of one-token sequences through the captured graphs."""
        bs = self.block_size
        ids, pos, slots, lens, tables, sample_rows = [], [], [], [], [], []
        for i, s in enumerate(batch):
            req = s.request
            p = req.num_computed_tokens
            ids.extend(req.token_ids(p, p + 1))
            pos.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(req.block_table())
            if p + 1 == req.num_tokens:
                sample_rows.append((i, req))
        return graphs.run(ids, pos, slots, tables, lens), sample_rows

    def _blend(self, req: Request) -> int:
        """A blended prefill of the whole prompt (see blend.py); returns the sampled token."""
        plan, req.blend = req.blend, None
        cached = plan.num_cached_tokens
        try:
            logits, recomputed = blend_prefill(self.model, self.kv_cache, req.prompt_token_ids,
                                               self.slots(req, 0, req.num_tokens), plan,
                                               self.launcher)
        finally:
            plan.release()
        req.num_blend_recomputed = recomputed
        self.num_forward_tokens += req.num_tokens - cached + recomputed
        return sample(logits[None], [req.params], [req.generator])[0]

    def slots(self, req: Request, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 paged-memory slots of the request's tokens [start, end)."""
        bs = self.block_size
        blocks = torch.tensor(req.block_ids, dtype=torch.int64)
        p = torch.arange(start, end)
        return blocks[p // bs] * bs + p % bs

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
            ids.extend(req.token_ids(lo, hi))
            pos.extend(range(lo, hi))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(lo, hi))
            seq_lens.append(hi)
            starts.append(starts[-1] + s.num_new_tokens)
            tables[i, : len(blocks)] = req.block_table()
            if hi == req.num_tokens:
                sample_rows.append((starts[-1] - 1, req))
        # host-built metadata, copied over without a sync: from pinned memory where the
        # device is a GPU (a copy from pageable memory would first wait for everything
        # queued on the engine's stream: this step's loads, the last step's saves)
        dev = self.device
        on = lambda t: (pinned(t) if dev.type == "cuda" else t).to(dev, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=on(torch.tensor(slots, dtype=torch.int64)),
            block_tables=on(tables),
            seq_lens=on(torch.tensor(seq_lens, dtype=torch.int64)),
            query_start_loc=on(torch.tensor(starts, dtype=torch.int64)),
            num_decodes=sum(1 for s in batch if s.num_new_tokens == 1),
            host_seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            host_query_start_loc=torch.tensor(starts, dtype=torch.int64),
            launcher=self.launcher,
        )
        return (on(torch.tensor(ids, dtype=torch.int64)), on(torch.tensor(pos, dtype=torch.int64)),
                meta, sample_rows)
