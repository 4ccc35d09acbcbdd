"""lmkv plugged into the bundled engine: both connector roles, and the step around them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from prometheus_client import CollectorRegistry

from lmkv.blend.segments import separator_tokens
from lmkv.cache import LMKVCache
from lmkv.config import LMKVConfig
from lmkv.connector import SchedulerConnector, WorkerConnector
from lmkv.layout import KVLayout
from lmkv.metrics import LMKVMetrics
from lmkv.model_id import model_fingerprint
from lmkv.paged import BlockPagedMemory

from .model_config import ModelConfig
from .model_runner import ModelRunner
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class StepResult(NamedTuple):
    sampled: dict[str, int]  # request id -> token sampled this step
    failed: list  # requests that must be recomputed (a load into their pages failed)
    failed_blocks: set[int]  # the pages that load was writing: their contents are unknown


class KVConnector:
    """The engine makes one call here per event: ``tokenize`` (blending splits prompts),
    ``execute`` (a step), ``request_finished`` (the quality gate may ask for a re-run)."""

    def __init__(self, config: LMKVConfig, mc: ModelConfig, dtype: torch.dtype, block_size: int,
                 model_dir: Path, kv_cache: torch.Tensor, registry: CollectorRegistry,
                 encode: Callable[[str, bool], list[int]], launcher=None):
        layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, config.chunk_size)
        self.cache = LMKVCache(config, layout, model_fingerprint(model_dir), LMKVMetrics(registry),
                               pin=kv_cache.device.type == "cuda")
        self._encode = encode
        # the separator's ids as running text has them (lmkv.blend.segments)
        self.blend_separator = separator_tokens(lambda text: encode(text, False),
                                                config.blend_special_str) if config.enable_blending else []
        self.scheduler = SchedulerConnector(self.cache, block_size, self.blend_separator)
        # a producer's saves must be stored when its request is reported done (drain)
        self.worker = WorkerConnector(self.cache, async_saves=config.kv_role != "producer")
        self.worker.register_kv_caches(BlockPagedMemory(kv_cache, launcher))
        self._checks: dict[str, list[int]] = {}  # quality-gate re-run id -> the tokens served
        # the engine forgets its prefix cache's pages (set by the engine): when the gate trips,
        # pages loaded lossy, and those computed over them, must not be served again
        self.forget_cached_pages: Callable[[], None] = lambda: None

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """With blending on, a prompt holding the separator: its parts tokenized separately
        (as precompute tokenized the chunks) and joined with the separator's ids. None
        otherwise: the engine tokenizes as usual. Thread-safe."""
        sep = self.cache.config.blend_special_str
        if not self.blend_separator or sep not in text:
            return None
        parts = text.split(sep)
        ids = self._encode(parts[0], add_special_tokens)
        for part in parts[1:]:
            ids += self.blend_separator + self._encode(part, False)
        return ids

    def request_finished(self, req: Request) -> Request | None:
        """``req`` finished (call before the scheduler frees it). lmkv's quality gate
        (codec_check_every) re-runs a sample of the greedy requests served lossy KV without
        any cached KV: the re-run to schedule is returned (it produces no output), and when
        it finishes both token lists go to the gate."""
        gate = self.cache.gate
        if gate is None:
            return None
        if req.request_id in self._checks:
            tripped = gate.tripped
            gate.record(req.output_token_ids, self._checks.pop(req.request_id))
            if gate.tripped and not tripped:  # lossless from now on, the engine's pages too
                self.forget_cached_pages()
                self.scheduler.forget_lossy()
            return None
        if not (req.params.greedy and self.scheduler.served_lossy(req) and gate.sample()):
            return None
        params = SamplingParams(max_tokens=len(req.output_token_ids), temperature=0, ignore_eos=True)
        rerun = Request(f"{req.request_id}#codec-check", list(req.prompt_token_ids), params,
                        arrival=time.monotonic(), cacheable=False, use_cache=False, internal=True)
        self._checks[rerun.request_id] = list(req.output_token_ids)
        return rerun

    def aborted(self, req: Request) -> None:
        """``req`` was aborted: a quality-gate re-run that will not finish is forgotten."""
        self._checks.pop(req.request_id, None)

    def complete_saves(self, wait: bool) -> None:
        """Chunks of earlier steps' saves whose copies are done go to the hot cache; with
        ``wait``, all of them (the host waits for their copies): before waiting requests
        are looked up (they must find them), and when the engine goes idle."""
        self.worker.complete_saves(wait=wait)

    def execute(self, runner: ModelRunner, sched: SchedulerOutput) -> StepResult:
        """One step with lmkv: load what was matched, run the model, save new chunks. If a
        load failed, the requests whose pages it was writing ran over stale KV: they are
        returned as ``failed`` (the engine recomputes them) and their new chunks are not
        saved."""
        meta = self.scheduler.build_connector_meta(
            (s.request, s.num_new_tokens) for s in sched.scheduled if s.request.use_cache
        )
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        # per-layer hooks only when a layer has something to wait for or to save (a step
        # without them, most decode steps, can replay a CUDA graph)
        hooks = (_LayerHooks(self.worker)
                 if self.worker.layerwise and (meta.loads or meta.saves) else None)
        blended = [s.request for s in sched.scheduled if s.request.blend is not None]
        failed, blocks = [], set()
        ran = False
        try:
            sampled = runner.execute(sched, hooks)
            ran = True
        finally:
            failed, blocks = self._failed_requests(sched)
            try:  # a forward pass that failed wrote some pages only: nothing of it is stored
                self.worker.wait_for_save(skip={r.request_id for r in failed}, store=ran)
            except Exception as e:  # a save costs a later recompute, never this step's requests
                log.warning("lmkv: saving this step's chunks failed (%s); they will be recomputed "
                            "next time", e)
                self.cache.count_error("connector", "save")
            for req in blended:
                self.cache.metrics.blend_recomputed_tokens.inc(req.num_blend_recomputed)
        for req in failed:
            sampled.pop(req.request_id, None)
        return StepResult(sampled, failed, blocks)

    def _failed_requests(self, sched: SchedulerOutput) -> tuple[list, set[int]]:
        """The pages a failed load was writing, and the requests of this step holding one
        (the load's own requests, and any that shares their pages through the prefix cache)."""
        failed = self.worker.failed_loads()
        if not failed:
            return [], set()
        blocks = set().union(*(spec.blocks(self.scheduler.block_size) for spec in failed))
        return [s.request for s in sched.scheduled if blocks.intersection(s.request.block_ids)], blocks

    def recompute(self, request) -> None:
        """``request`` will be recomputed from the start without lmkv's KV."""
        self.scheduler.recompute_without_loads(request)

    def close(self) -> None:
        self.worker.close()
        self.cache.close()


class _LayerHooks:
    def __init__(self, worker: WorkerConnector):
        self.worker = worker

    def before_attention(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def after_attention(self, layer: int) -> None:
        self.worker.save_kv_layer(layer)

