"""LMKVConnector: lmkv as a vLLM V1 KV connector.

    --kv-transfer-config '{"kv_connector": "LMKVConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "lmkv_engines.vllm.connector",
        "kv_connector_extra_config": {"chunk_size": 256, "local_disk": "/tmp/lmkv"},
        "kv_load_failure_policy": "recompute"}'

Configuration: lmkv's usual sources (defaults < YAML at LMKV_CONFIG_FILE < LMKV_* env),
then ``kv_connector_extra_config`` on top, key for key (unknown keys fail, naming the key).

vLLM builds this class once per role; both delegate to lmkv's connector roles
(``lmkv.connector``). The worker role owns the LMKVCache (the hot cache beside the KV
memory); the scheduler role asks it by key over a Unix socket (lookup_socket.py), whether
vLLM runs the two roles in one process or, as ``vllm serve`` does, in two: one code path.

Loads are synchronous (done before the forward pass, or layer by layer with
use_layerwise); a request whose chunks are still coming up from a lower tier is left
waiting (vLLM admits others meanwhile) until they are in the hot cache. Saves gather the
step's new full chunks into lmkv's hot cache at the end of the step, and lower tiers are
written in the background. Any failure inside lmkv costs
a recompute, never a failed request: lookups that fail report no hit, loads that fail
report their blocks through get_block_ids_with_load_errors (set vLLM's
``kv_load_failure_policy`` to "recompute"), and saves that fail store nothing.
"""

from __future__ import annotations

import atexit
import errno
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmkv.cache import LMKVCache
from lmkv.connector import ConnectorMetadata, SchedulerConnector, WorkerConnector
from lmkv.logs import LogThrottle
from lmkv.paged import PagedMemory

from .engines import engine_spec, rank_config
from .lookup_socket import LookupClient, LookupServer, socket_path
from .paged import StridedPagedMemory, cpu_paged_memory, gpu_paged_memory
from .requests import RequestViews

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
# steps after a failed load whose saves are dropped too: vLLM's async scheduling plans one
# step ahead of the outputs it has processed
SAVE_PAUSE_STEPS = 1


def _show_lmkv_logs() -> None:
    """vLLM sets up its own loggers only: lmkv's INFO lines (what it uses at start-up,
    which process answers lookups) and warnings go to stderr beside vLLM's, unless the
    application configured logging itself."""
    if logging.getLogger().handlers:
        return
    for name in ("lmkv", "lmkv_engines"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


_show_lmkv_logs()


def worker_engine() -> LMKVCache:
    """The LMKVCache of this process's worker role (vLLM's KV connector of this process),
    for benchmarks and tests that read its metrics or drain its writes."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if not isinstance(connector, LMKVConnector) or connector.worker is None:
        raise RuntimeError("no lmkv worker role in this process")
    return connector.cache


class LMKVConnectorMetadata(KVConnectorMetadata):
    """lmkv's per-step metadata: keys, token ranges and slots (pickled by vLLM)."""

    def __init__(self, meta: ConnectorMetadata):
        self.meta = meta


class LMKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        self.spec = engine_spec(vllm_config, extra)
        self.engine_id = str(kv.engine_id)
        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
        self.block_size = self.spec.block_size
        self.scheduler: SchedulerConnector | None = None
        self.worker: WorkerConnector | None = None
        self.lookups: LookupServer | None = None
        self.cache: LMKVCache | LookupClient
        if role == KVConnectorRole.SCHEDULER:
            # vLLM builds the scheduler after its workers, which serve their sockets by then
            paths = [socket_path(self.engine_id, dp_rank, r) for r in range(self.spec.tp_size)]
            self.cache = LookupClient(self.spec.config, paths)
            self.scheduler = SchedulerConnector(self.cache, self.block_size)
            self.views = RequestViews()
        else:
            tp_rank = _tp_rank() if self.spec.tp_size > 1 else 0
            layout = replace(self.spec.layout, rank=tp_rank)  # each rank stores its own shard
            config = rank_config(self.spec.config, tp_rank, self.spec.tp_size, dp_rank)
            self.cache = LMKVCache(config, layout, self.spec.model_id)
            atexit.register(self.shutdown)  # vLLM may exit without shutting connectors down
            path = socket_path(self.engine_id, dp_rank, tp_rank)
            try:
                self.lookups = LookupServer(self.cache, path)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:  # its scheduler would pin in the other's worker
                    raise RuntimeError(
                        f"lmkv: another vLLM instance with engine_id {self.engine_id!r} serves "
                        f"lmkv lookups on {path}; give each instance its own engine_id") from e
                log.warning("lmkv: cannot serve lookups on %s (%s); the scheduler role will "
                            "find no hits", path, e)
            # the scheduler names chunks by rank-free ids: this rank's keys are its shard's
            self._init_worker(WorkerConnector(self.cache, key_of=self.cache.key_of))
            if self.spec.tp_size > 1:
                self._any_rank = _any_tp_rank
        self._closed = False
        self._quiet = LogThrottle()

    def _init_worker(self, worker: WorkerConnector) -> None:
        self.worker = worker
        self.layer_index: dict[str, int] = {}
        self.paged: PagedMemory | None = None
        self._load_errors: set[int] = set()
        self._load_failed: bool | None = None  # this step's loads, once asked
        # steps left whose saves are dropped after a failed load: with async scheduling vLLM
        # schedules a step before it learns of the last one's invalid blocks, so a request
        # there may compute over them (through its prefix cache)
        self._no_saves = 0
        self._save_failed = False
        # whether a load failed on any rank, given this rank's (every rank computes over the
        # others' attention, so a failure anywhere spoils every rank's new KV of the step)
        self._any_rank: Callable[[bool], bool] = lambda failed: failed

    @property
    def requires_kv_delivery(self) -> bool:
        """False in every role: lmkv copies a chunk out of its blocks within the step that
        computes it and holds no block past it, and a dropped save is a later miss (vLLM's
        default, True for a producer, would recompute requests preempted under async
        scheduling for nothing)."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads and saves wait and copy in hooks between layers, which a full
        CUDA graph's replay skips (the forward would read pages still being loaded): vLLM
        then captures piecewise graphs."""
        from lmkv.config import ConfigError, load_config

        try:
            return load_config(**dict(extra_config or {})).use_layerwise
        except ConfigError:
            return False  # reported by name when the connector starts

    # ==== scheduler role ================================================================
    def on_new_request(self, request: Request) -> None:
        try:
            self.scheduler.on_new_request(self.views.get(request))
        except Exception as e:
            self._quiet.log(log, logging.WARNING, "prefetch", "lmkv: prefetch for request %s "
                            "failed: %r", request.request_id, e)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """None while the request's chunks are still coming up from a lower tier (vLLM then
        admits others and asks again next step: looking it up now would hold the scheduler,
        and every running request, for the whole read); else the tokens lmkv loads."""
        view = self.views.get(request)
        view.num_computed_tokens = num_computed_tokens
        try:
            if self.scheduler.loads_arriving(view, num_computed_tokens):
                return None, False
        except Exception as e:
            if not isinstance(e, OSError):  # (a worker that does not answer is told once)
                self._quiet.log(log, logging.ERROR, "arriving", "lmkv: asking whether request "
                                "%s's chunks are on their way failed; looking it up now: %r",
                                request.request_id, e)
        try:
            n, _ = self.scheduler.get_num_new_matched_tokens(view, num_computed_tokens)
        except Exception as e:
            if not isinstance(e, OSError):  # (a worker that does not answer is told once)
                self._quiet.log(log, logging.ERROR, "lookup", "lmkv: lookup for request %s "
                                "failed; computing it: %r", request.request_id, e)
            self.cache.count_error("connector", "lookup")
            return 0, False
        if n:
            log.debug("lmkv: request %s: loading tokens [%d, %d) of %d", request.request_id,
                      num_computed_tokens, num_computed_tokens + n, len(view.prompt_token_ids))
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        view = self.views.get(request)
        view.block_ids = list(blocks.get_block_ids()[0])
        # vLLM has not added the local prefix-cache hit to request.num_computed_tokens yet;
        # the view still holds it from get_num_new_matched_tokens
        self.scheduler.update_state_after_alloc(view, view.block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self.scheduler.build_connector_meta(self.views.scheduled(scheduler_output))
        return LMKVConnectorMetadata(meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Saves finish within the step that computes a chunk, so the blocks are free now."""
        view = self.views.pop(request.request_id)
        if view is not None:
            self.scheduler.request_finished(view)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks whose load failed leave vLLM's prefix cache, with every later block of the
        requests holding them (computed over them in that step): with kv_load_failure_policy
        "recompute" vLLM keeps them cached while their requests recompute them, so a request
        admitted meanwhile would attend over pages never written. Their holders keep them."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        manager = self._kv_cache_manager
        if not invalid or manager is None or self.scheduler is None:
            return
        evict = set(invalid)
        for rid in list(self.views.views):
            blocks = manager.get_block_ids(rid)
            if len(blocks) != 1:  # (one group: models of several are refused at start)
                continue
            first = next((i for i, b in enumerate(blocks[0]) if b in invalid), None)
            if first is not None:
                evict.update(blocks[0][first:])
        manager.evict_blocks(evict)
        log.warning("lmkv: %d blocks whose load failed (and %d computed over them) left vLLM's "
                    "prefix cache until they are computed again", len(invalid),
                    len(evict) - len(invalid))

    def reset_cache(self) -> bool:
        """vLLM resets its caches (its prefix cache with reset_connector, as after loading new
        weights in place): this instance loads no chunk stored before now again (they may
        hold the old weights' KV; other instances sharing the tiers keep using them)."""
        if self.scheduler is None:
            return True
        self.scheduler.reset()
        log.warning("lmkv: vLLM reset its caches: chunks stored before now are not loaded by "
                    "this instance again (its weights may have changed)")
        return True

    # ==== worker role ===================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.platforms import current_platform

        names = sorted(kv_caches, key=extract_layer_index)
        self.layer_index = {name: i for i, name in enumerate(names)}
        layers = [kv_caches[name] for name in names]  # each [num_blocks, Hkv, block_size, 2 * D]
        if current_platform.is_cpu():
            self.paged = cpu_paged_memory(layers)
            _check_cpu_layout(self.paged, layers[0])
        else:
            self.paged = gpu_paged_memory([t.transpose(1, 2) for t in layers])
        if self.paged.block_size != self.block_size:
            raise ValueError(f"vLLM's KV blocks hold {self.paged.block_size} tokens, its config says "
                             f"{self.block_size}")
        self.worker.register_kv_caches(self.paged)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv()  # a failure is reported by failed_loads in wait_for_save

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(self.layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._save_failed:
            return
        try:
            self.worker.save_kv_layer(self.layer_index[layer_name])
        except Exception:
            log.exception("lmkv: saving layer %s failed; this step's chunks are not stored", layer_name)
            self._save_failed = True

    def _loads_failed(self) -> bool:
        """Whether a load of this step failed (its blocks then go to vLLM through
        get_block_ids_with_load_errors). Asked once a step: vLLM may ask for the errors before
        wait_for_save (speculative decoding defers that until after the draft model)."""
        if self._load_failed is None:
            failed = self.worker.failed_loads()
            for spec in failed:
                self._load_errors.update(spec.blocks(self.block_size))
            # (the loads are the same on every rank, so every rank asks the others here)
            self._load_failed = bool(self.worker.meta.loads) and self._any_rank(bool(failed))
            if self._load_failed:
                log.warning("lmkv: a load failed%s; this step's and the next %d steps' new chunks "
                            "are not stored", "" if failed else " on another rank",
                            SAVE_PAUSE_STEPS)
                self._no_saves = SAVE_PAUSE_STEPS + 1  # this step's included
        return self._load_failed

    def wait_for_save(self) -> None:
        # vLLM recomputes the blocks reported by get_block_ids_with_load_errors, and every
        # request that reached them through its prefix cache this step: none of this step's
        # chunks is stored then (which requests shared the pages is vLLM's to know)
        self._loads_failed()
        store = self._no_saves == 0 and not self._save_failed
        self._no_saves = max(0, self._no_saves - 1)
        try:
            # after a failed layer save this waits for the gathers and returns the buffers
            self.worker.wait_for_save(store=store)
            if self._save_failed:
                raise RuntimeError("a layer failed to save")
        except Exception as e:
            log.warning("lmkv: saving KV failed (%s); those chunks will be recomputed next time", e)
            self.cache.count_error("connector", "save")
            self.worker.meta = ConnectorMetadata()
        finally:
            self._save_failed = False

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, LMKVConnectorMetadata)
        self.worker.bind_connector_metadata(connector_metadata.meta)
        self._load_failed = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker.meta.loads:  # this step's loads are asked about now, if not yet
            self._loads_failed()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ==== both ==========================================================================
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.lookups is not None:
            self.lookups.close()
        if self.worker is not None:
            self.worker.close()
            atexit.unregister(self.shutdown)
        self.cache.close()  # the worker's: finish background writes


def _any_tp_rank(failed: bool) -> bool:
    """Whether a load failed on any tensor-parallel rank this step: one all-reduce on the
    group's CPU side, in steps with loads only."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    flag = torch.tensor([int(failed)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return bool(flag.item())


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _check_cpu_layout(paged: StridedPagedMemory, like: torch.Tensor) -> None:
    """Write known K/V with vLLM's own CPU cache kernel into a scratch block and read them
    back through ``paged``'s layout, so a kernel that lays pages out differently (another
    CPU ISA, another vLLM version) fails here instead of corrupting outputs."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, h, bs, d2 = like.shape
    d = d2 // 2
    scratch = torch.zeros(1, h, bs, d2, dtype=like.dtype)
    key = torch.arange(bs * h * d, dtype=torch.float32).view(bs, h, d).to(like.dtype)
    value = -key - 1
    halves = scratch.view(1, h, 2 * bs, d).chunk(2, dim=2)
    isa = _get_attn_isa(like.dtype, bs, d)
    ops.cpu_attn_reshape_and_cache(key, value, halves[0], halves[1], torch.arange(bs), isa)
    probe = cpu_paged_memory([scratch])
    chunk = torch.empty(2, 1, bs, h, d, dtype=like.dtype)
    probe.save(torch.arange(bs), chunk)
    if not (torch.equal(chunk[0, 0], key) and torch.equal(chunk[1, 0], value)):
        raise NotImplementedError(
            f"lmkv does not know the page layout of vLLM's CPU attention kernels for ISA {isa!r} "
            f"(dtype {like.dtype}, block size {bs}, head_dim {d}); supported: the 'vec' layout")
