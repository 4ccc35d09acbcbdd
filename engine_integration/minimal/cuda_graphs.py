"""CUDA graphs of the decode step: the whole forward pass of a batch of one-token sequences
(embedding, 30-odd layers of projections, RoPE, cache writes, lmkv's attention kernel),
captured once per padded batch size and replayed with one launch, so that a decode step
costs the GPU's time rather than the host's (eager, each layer queues ~40 kernels).

The graph reads its inputs from static device buffers that each step overwrites: token ids,
positions, cache slots, block tables of a fixed width (max_model_len / block_size, so the
attention kernel's partition count never changes; a step copies only the columns its
sequences use) and context lengths. Rows beyond the batch are padding: slot -1 (nothing
written), context length 1 over the first block id in their row (a valid block: read only).
Steps that are not pure decodes, that run lmkv's per-layer hooks, or that are larger than
the largest graph run eagerly."""

from __future__ import annotations

import logging
from bisect import bisect_left

import torch

from .attention_metadata import AttentionMetadata
from .model import LlamaForCausalLM

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 max_model_len: int, max_num_seqs: int):
        self.model = model
        self.kv_cache = kv_cache
        dev = kv_cache.device
        self.sizes = [b for b in BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        big = self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(big, **i64)
        self.positions = torch.zeros(big, **i64)
        self.slots = torch.full((big,), -1, **i64)
        self.block_tables = torch.zeros(big, self.width, **i64)
        self.seq_lens = torch.ones(big, **i64)
        self.query_start_loc = torch.arange(big + 1, **i64)
        # host images of the buffers (pinned: one asynchronous copy each per step)
        self._host = {name: torch.empty(getattr(self, name).shape, dtype=torch.int64, pin_memory=True)
                      for name in ("input_ids", "positions", "slots", "block_tables", "seq_lens")}
        self._copied = torch.cuda.Event()  # the last step's copies out of the host images
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        """Capture one graph per batch size, largest first (smaller ones reuse its memory)."""
        pool = None
        stream = torch.cuda.Stream(self.kv_cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                meta = self._meta(b)
                for _ in range(2):  # warm-up: kernels loaded, workspaces sized (writes nothing)
                    self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, meta, None)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_cache,
                                        meta, None)
                pool = graph.pool()
                self._graphs[b], self._hidden[b] = graph, hidden
        torch.cuda.current_stream(self.kv_cache.device).wait_stream(stream)
        log.info("captured CUDA graphs of the decode step for batch sizes %s", self.sizes)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[: b + 1],
            num_decodes=b,
        )

    def fits(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
        """The final hidden states [n, hidden] of n decode tokens (n <= the largest size)."""
        n = len(ids)
        b = self.sizes[bisect_left(self.sizes, n)]
        h = self._host
        self._copied.synchronize()  # done long ago: the last step's sampling waited for it
        h["input_ids"][:n] = torch.tensor(ids)
        h["positions"][:n] = torch.tensor(positions)
        h["slots"][:n] = torch.tensor(slots)
        h["seq_lens"][:n] = torch.tensor(seq_lens)
        width = max(len(row) for row in tables)  # columns past a row's blocks are never read
        for i, row in enumerate(tables):
            h["block_tables"][i, : len(row)] = torch.tensor(row)
        if b > n:  # padding rows: nothing written, one key read
            h["input_ids"][n:b] = 0
            h["positions"][n:b] = 0
            h["slots"][n:b] = -1
            h["seq_lens"][n:b] = 1
        for name, host in h.items():
            if name == "block_tables":  # padding rows keep old ids: valid blocks, read only
                self.block_tables[:n, :width].copy_(host[:n, :width], non_blocking=True)
            else:
                getattr(self, name)[:b].copy_(host[:b], non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.kv_cache.device))
        self._graphs[b].replay()
        return self._hidden[b][:n]
