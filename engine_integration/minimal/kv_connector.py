"""lmkv plugged into the bundled engine: both connector roles, and the step around them."""

from __future__ import annotations

from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from lmkv.config import LMKVConfig
from lmkv.connector import SchedulerConnector, WorkerConnector
from lmkv.engine import LMKVEngine
from lmkv.layout import KVLayout
from lmkv.metrics import LMKVMetrics
from lmkv.model_id import model_fingerprint
from lmkv.paged import BlockPagedMemory

from .model_config import ModelConfig
from .model_runner import ModelRunner
from .scheduler import SchedulerOutput


class KVConnector:
    def __init__(self, config: LMKVConfig, mc: ModelConfig, dtype: torch.dtype, block_size: int,
                 model_dir: Path, kv_cache: torch.Tensor, registry: CollectorRegistry,
                 blend_separator: list[int] | None = None):
        layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, config.chunk_size)
        self.engine = LMKVEngine(config, layout, model_fingerprint(model_dir), LMKVMetrics(registry))
        self.scheduler = SchedulerConnector(self.engine, block_size, blend_separator)
        self.worker = WorkerConnector(self.engine)
        self.worker.register_kv_caches(BlockPagedMemory(kv_cache))

    def execute(self, runner: ModelRunner, sched: SchedulerOutput) -> dict[str, int]:
        """One step with lmkv: load what was matched, run the model, save new chunks."""
        meta = self.scheduler.build_connector_meta(
            (s.request, s.num_new_tokens) for s in sched.scheduled if s.request.use_cache
        )
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        hooks = _LayerHooks(self.worker) if self.worker.layerwise else None
        blended = [s.request for s in sched.scheduled if s.request.blend is not None]
        try:
            return runner.execute(sched, hooks)
        finally:
            self.worker.wait_for_save()
            for req in blended:
                self.engine.metrics.blend_recomputed_tokens.inc(req.num_blend_recomputed)

    def close(self) -> None:
        self.worker.close()
        self.engine.close()


class _LayerHooks:
    def __init__(self, worker: WorkerConnector):
        self.worker = worker

    def before_attention(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def after_attention(self, layer: int) -> None:
        self.worker.save_kv_layer(layer)

