"""CUDA graphs of the decode step: the whole forward pass of a batch of one-token sequences
(embedding, 30-odd layers of projections, RoPE, cache writes, lmkv's attention kernel),
captured once per padded batch size and block-table width and replayed with one launch, so
that a decode step costs the GPU's time rather than the host's (eager, each layer queues ~40
kernels).

The graph reads its inputs from static device buffers that each step overwrites: token ids,
positions, cache slots, context lengths and block tables. A block table's width fixes the
attention kernel's partition count (512 keys each; a sequence above 32K keys has longer
ones, at most MAX_PARTITIONS), so graphs are captured per width bucket (8K tokens, then x4,
up to max_model_len): a step replays the narrowest bucket that holds its longest sequence,
and partitions past a sequence's own exit at once (a sequence's split follows its length
only, so its output does not depend on the bucket or the batch). Rows
beyond the batch are padding: slot -1 (nothing written), context length 1 over whatever
block id their row's first column holds (a valid block: read only). Steps that are not pure
decodes, that run lmkv's per-layer hooks, or that are larger than the largest graph run
eagerly.

Under the CUDA emulator (``device="emulate"``) a "graph" re-runs the forward pass over the
same static buffers, so the staging above runs and is tested without a GPU."""

from __future__ import annotations

import contextlib
import logging
from bisect import bisect_left
from collections.abc import Callable

import torch

from .attention_metadata import AttentionMetadata
from .model import LlamaForCausalLM

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # then every 128
WIDTH_TOKENS = 8192  # the narrowest block-table bucket, in tokens; each next one is 4x


def batch_sizes(max_num_seqs: int) -> list[int]:
    more = range(BATCH_SIZES[-1] + 128, max_num_seqs, 128)
    return [b for b in (*BATCH_SIZES, *more) if b < max_num_seqs] + [max_num_seqs]


def widths(max_model_len: int, block_size: int) -> list[int]:
    """Block-table widths (in blocks) of the graphs, narrowest first."""
    tokens, out = WIDTH_TOKENS, []
    while tokens < max_model_len:
        out.append(tokens // block_size)
        tokens *= 4
    full = -(-max_model_len // block_size)
    return [w for w in out if w < full] + [full]


class _Rerun:
    """The emulator's stand-in for a CUDA graph: replay runs the captured call again."""

    def __init__(self, run: Callable[[], torch.Tensor]):
        self.run = run
        self.out = run()

    def replay(self) -> None:
        self.out = self.run()


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 max_model_len: int, max_num_seqs: int, launcher=None):
        self.model = model
        self.kv_cache = kv_cache
        self.launcher = launcher  # the emulator's (None on CUDA)
        dev = kv_cache.device
        self.cuda = dev.type == "cuda"
        self.sizes = batch_sizes(max_num_seqs)
        self.widths = widths(max_model_len, block_size)
        big = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(big, **i64)
        self.positions = torch.zeros(big, **i64)
        self.slots = torch.full((big,), -1, **i64)
        # one flat buffer; the tables of width w are its first big * w entries as [big, w]
        self.block_tables = torch.zeros(big * self.widths[-1], **i64)
        self.seq_lens = torch.ones(big, **i64)
        self.query_start_loc = torch.arange(big + 1, **i64)
        # host images of the buffers (pinned: one asynchronous copy each per step)
        self._host = {name: torch.zeros(getattr(self, name).shape, dtype=torch.int64,
                                        pin_memory=self.cuda)
                      for name in ("input_ids", "positions", "slots", "block_tables", "seq_lens")}
        self._copied = torch.cuda.Event() if self.cuda else None  # the last step's copies
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | _Rerun] = {}
        self._hidden: dict[tuple[int, int], torch.Tensor] = {}

    def capture(self) -> None:
        """Capture one graph per batch size and width, largest first (the smaller ones reuse
        its memory)."""
        pool = None
        dev = self.kv_cache.device
        stream = torch.cuda.Stream(dev) if self.cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for b in reversed(self.sizes):
                for w in reversed(self.widths):
                    meta = self._meta(b, w)
                    run = lambda b=b, meta=meta: self.model(  # noqa: E731
                        self.input_ids[:b], self.positions[:b], self.kv_cache, meta, None)
                    if not self.cuda:
                        self._graphs[b, w] = _Rerun(run)
                        continue
                    for _ in range(2):  # warm-up: kernels loaded, workspaces sized (writes nothing)
                        run()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._hidden[b, w] = run()
                    pool = graph.pool()
                    self._graphs[b, w] = graph
        if stream is not None:
            torch.cuda.current_stream(dev).wait_stream(stream)
        log.info("captured %s graphs of the decode step for batch sizes %s and block-table "
                 "widths %s", "CUDA" if self.cuda else "emulated", self.sizes, self.widths)

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        tables = self.block_tables[: self.sizes[-1] * w].view(-1, w)
        return AttentionMetadata(
            slot_mapping=self.slots[:b], block_tables=tables[:b], seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1], num_decodes=b,
            launcher=self.launcher,
        )

    def fits(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: list[torch.Tensor], seq_lens: list[int]) -> torch.Tensor:
        """The final hidden states [n, hidden] of n decode tokens (n <= the largest size)."""
        n = len(ids)
        b = self.sizes[bisect_left(self.sizes, n)]
        w = self.widths[bisect_left(self.widths, max(len(row) for row in tables))]
        h = self._host
        if self._copied is not None:
            self._copied.synchronize()  # done long ago: the last step's sampling waited for it
        h["input_ids"][:n] = torch.tensor(ids)
        h["positions"][:n] = torch.tensor(positions)
        h["slots"][:n] = torch.tensor(slots)
        h["seq_lens"][:n] = torch.tensor(seq_lens)
        host_tables = h["block_tables"][: n * w].view(n, w)  # contiguous: copied asynchronously
        for i, row in enumerate(tables):  # columns past a row's blocks are never read
            host_tables[i, : len(row)] = row
        if b > n:  # padding rows: nothing written, one key read
            h["input_ids"][n:b] = 0
            h["positions"][n:b] = 0
            h["slots"][n:b] = -1
            h["seq_lens"][n:b] = 1
        for name, host in h.items():
            if name == "block_tables":  # padding rows keep old ids: valid blocks, read only
                self.block_tables[: n * w].copy_(host[: n * w], non_blocking=True)
            else:
                getattr(self, name)[:b].copy_(host[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.kv_cache.device))
        graph = self._graphs[b, w]
        graph.replay()
        return (graph.out if isinstance(graph, _Rerun) else self._hidden[b, w])[:n]
