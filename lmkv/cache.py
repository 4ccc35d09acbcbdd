"""LMKVCache: lmkv for one model on one rank. Keys, the memory pool and the tier stack."""

from __future__ import annotations

import logging

import torch

from . import transfer
from .backends.base import BackendError, StorageBackend
from .blend.plan import BlendPlan, CachedSegment
from .blend.segments import split_segments
from .codec import get_codec, max_frame_bytes
from .codec.calibration import CacheGenTable
from .codec.gate import QualityGate
from .config import ConfigError, LMKVConfig
from .keys import KeyScope, content_hashes, prefix_hashes, tail_hash
from .layout import KVLayout
from .logs import LogThrottle
from .memory import HEADER_BYTES, NO_POSITION, ChunkBuffer, MemoryPool
from .metrics import LMKVMetrics
from .storage.manager import BroughtUp, StorageManager
from .storage.pins import PinTable
from .storage.tier import Tier

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 30.0  # seconds drain waits for the writes queued below the hot cache (below
# the lookup socket's call timeout: vLLM's scheduler asks a worker to drain through it)


class LMKVCache:
    def __init__(self, config: LMKVConfig, layout: KVLayout, model: str,
                 metrics: LMKVMetrics | None = None, pin: bool | None = None):
        """``pin``: page-lock the hot cache for copies to a GPU (default: where torch sees
        one; an engine on the CPU says False)."""
        if layout.chunk_size != config.chunk_size:
            raise ValueError(f"layout chunk size {layout.chunk_size} != config {config.chunk_size}")
        self.config = config
        self.layout = layout
        self._quiet = LogThrottle()
        self.scope = KeyScope(model, layout, config.cache_salt)
        self.metrics = metrics or LMKVMetrics()
        if config.enable_blending and config.blend_check_layer >= layout.num_layers:
            raise ConfigError(  # before any pool, file or thread is opened
                f"lmkv config key blend_check_layer is {config.blend_check_layer}, but the model "
                f"has {layout.num_layers} layers (0..{layout.num_layers - 1})")
        self.pool = MemoryPool(layout, config.hot_cache_bytes, pin=pin)
        self.storage = StorageManager(self.pool, self._build_tiers(), self.metrics,
                                      config.io_queue_size, keep_hot=config.local_cpu,
                                      policy=config.cache_policy)
        self.pins = PinTable()
        self.gate: QualityGate | None = None
        if config.quality_check_every and any(t.lossy for t in self.storage.tiers):
            self.gate = QualityGate(config.quality_check_every, config.codec_min_agreement,
                                    self.metrics, self.storage.make_lossless)
        self._metrics_server = self._serve_metrics() if config.metrics_port else None
        transfer.library()  # the CPU's paged copies built now (once per machine), not at the first load
        log.info(
            "lmkv ready: %s; %d chunk slots of %.3g MB in CPU memory; cache policy %s%s",
            config.describe(), self.pool.num_slots, layout.chunk_bytes / 1e6, config.cache_policy,
            "; quality gate on" if self.gate else "",
        )
        for tier in self.storage.tiers:  # (a store down at start shows in the log now)
            if tier.name == "remote":
                tier.probe_at_start()

    def _build_tiers(self) -> list[Tier]:
        tiers = []
        table = self._calibration() if self.config.uses_cachegen else None
        if self.config.local_disk:
            from .backends.disk import DiskBackend

            one = HEADER_BYTES + self.layout.chunk_bytes  # a chunk's file, raw
            if self.config.disk_bytes < one:  # (it would fail every write, for ever)
                raise ValueError(f"lmkv config key max_local_disk_size: {self.config.max_local_disk_size:g} "
                                 f"GB holds no chunk of this model ({one / 1e9:.3g} GB each, "
                                 f"{self.layout.chunk_size} tokens): give more")
            try:
                backend = DiskBackend(self.config.local_disk, self.config.disk_bytes,
                                      self.config.cache_policy, direct=self.config.local_disk_direct,
                                      max_value_bytes=max_frame_bytes(self.layout.chunk_bytes))
            except BackendError as e:
                raise ValueError(f"lmkv config key local_disk: {e}") from e
            tiers.append(_tier("disk", backend, self.config.local_disk_codec, table, self.metrics))
        if self.config.remote_url:
            from .backends.registry import create_backend

            backend = create_backend(self.config.remote_url, self.config.remote_timeout,
                                     max_frame_bytes(self.layout.chunk_bytes))
            tiers.append(_tier("remote", backend, self.config.remote_serde, table, self.metrics))
        return tiers

    def _calibration(self) -> CacheGenTable | None:
        """The cachegen table of this scope, or None (then cachegen tiers use zstd)."""
        from .codec.calibration import default_path

        path = self.config.cachegen_calibration or default_path(self.scope.prefix)
        try:
            table = CacheGenTable.load(path)
            table.check_layout(self.layout.chunk_shape)
        except FileNotFoundError:
            log.warning("lmkv: no cachegen calibration at %s; storing lossless (zstd) instead. "
                        "Calibrate with: engine calibrate --model DIR", path)
            return None
        except ValueError as e:
            raise ValueError(f"lmkv config key cachegen_calibration: {path}: {e}") from e
        log.info("lmkv: cachegen calibration %016x from %s", table.table_id, path)
        if table.basis is not None:
            from .codec import cachegen, native

            lib = native.library()  # built now (about a second, once per machine), not at the first load
            cachegen.forced_product()  # a bad LMKV_CODEC_PRODUCT is refused at start, on any CPU
            if lib is None or not lib.lmkv_amx():  # timed now, before any load runs beside it
                heads, dim = table.step.shape[2:]
                cachegen.product_dtype(heads * dim)
        return table

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    def keys(self, tokens: list[int], max_chunks: int | None = None) -> list[str]:
        """Keys of the full chunks of ``tokens`` (chained: each names its whole prefix)."""
        hashes = prefix_hashes(tokens, self.chunk_size)
        if max_chunks is not None:
            hashes = hashes[:max_chunks]
        return [self.scope.key(h) for h in hashes]

    def tail_key(self, tokens: list[int]) -> str | None:
        """The key of ``tokens``' partial last chunk (save_unfull_chunk), or None."""
        h = tail_hash(tokens, self.chunk_size)
        return None if h is None else self.scope.key(h)

    def key_of(self, chunk_id: str) -> str:
        """The key of a rank-free chunk id (``lmkv.keys.chunk_ids``) in this cache's scope."""
        return self.scope.key(bytes.fromhex(chunk_id))

    def lookup(self, keys: list[str]) -> int:
        """Number of leading chunks stored in some tier."""
        return self.storage.lookup(keys)

    def touch(self, keys: list[str]) -> None:
        """The engine used the leading ``keys`` without lmkv (its own prefix cache held
        them): a use to the hot cache's policy, as a load would be, so that the chunks the
        prompt continues are not the first it evicts; one whose write below was lost is
        written again."""
        self.storage.touch(keys)

    def fetch(self, keys: list[str], parent: str | None = None,
              again: bool = False) -> list[ChunkBuffer]:
        """The longest loadable prefix of chunks, each retained for the caller (``parent``:
        the chunk before ``keys[0]`` in its prompt, None for a prompt's first chunk or RAG
        chunks, which have none; ``again``: asked before for the same request, not served
        yet: hot chunks are not counted as hits or uses again)."""
        return self.storage.fetch(keys, parent, again)

    # ---- pins: the scheduler role plans a load by key, the worker role takes the chunks ----
    def pin(self, keys: list[str], parent: str | None = None, again: bool = False) -> list[bool]:
        """Pin the longest loadable prefix of ``keys`` in the hot cache (fetching from the
        tiers below; ``parent``: the chunk before ``keys[0]`` in its prompt; ``again`` as
        for fetch) for a load: one flag per pinned chunk, True where it was decoded from a
        lossy codec. Each pin is taken by the load (``take``) or given back (``unpin``)."""
        bufs = self.fetch(keys, parent, again)
        self.pins.add(keys[: len(bufs)], bufs)
        return [b.lossy for b in bufs]

    def take(self, key: str) -> ChunkBuffer | None:
        """The chunk of one pin of ``key``, retained for the caller; None if none is pinned."""
        return self.pins.take(key)

    def unpin(self, keys: list[str]) -> None:
        """Give back one pin of each key."""
        self.pins.give_back(keys)

    def prefetch(self, keys: list[str], parent: str | None = None) -> None:
        """Pull the leading stored chunks of ``keys`` (the chunks after ``parent`` in their
        prompt) into the hot cache in the background."""
        if self.config.enable_prefetch:
            self.storage.prefetch(keys, parent)

    def bring_up(self, keys: list[str], parent: str | None = None) -> BroughtUp | None:
        """Where a prefetch holds some of ``keys``, start reading them into the hot cache now,
        ahead of queued background work, without waiting: done() once they are there, held
        there until release() (None: none is held, or the job was not queued)."""
        return self.storage.bring_up(keys, parent)

    def record_lookup(self, prompt_tokens: int, hit_tokens: int, engine_tokens: int = 0) -> None:
        self.metrics.record_lookup(prompt_tokens, hit_tokens, engine_tokens)

    def record_blend(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.metrics.record_blend(prompt_tokens, hit_tokens)

    def count_error(self, where: str, kind: str) -> None:
        self.metrics.errors.labels(where, kind).inc()

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Wait until every queued write below the hot cache has finished; False (logged)
        if they have not within ``timeout`` seconds (a tier call is stuck)."""
        if not self.storage.io_stuck() and self.storage.io.drain(timeout):
            return True
        self._quiet.log(log, logging.ERROR, "drain", "lmkv: %d background writes still queued "
                        "(a tier call is stuck?); going on without them", self.storage.io.pending())
        return False

    def allocate(self) -> ChunkBuffer | None:
        self.pins.sweep()  # stale pins hold slots that saves need
        return self.storage.allocate()

    def store(self, key: str, buf: ChunkBuffer, parent: str | None = None) -> bool:
        """Store one chunk; ``parent`` is the key of the chunk before it in its prompt.
        False if it went nowhere (the hot cache's policy refused it, no tier write queued)."""
        return self.storage.put(key, buf, parent)

    # ---- RAG chunks (CacheBlend): keyed by content, reusable anywhere in a prompt ----------
    def content_keys(self, tokens: list[int]) -> list[str]:
        pre_rope = self.config.blend_store_pre_rope
        return [self.scope.key(h) for h in content_hashes(tokens, self.chunk_size, pre_rope)]

    def has_chunk(self, tokens: list[int]) -> bool:
        keys = self.content_keys(tokens)
        return self.lookup(keys) == len(keys)

    def store_chunk(self, tokens: list[int], kv: torch.Tensor) -> bool:
        """Store a RAG chunk's KV, kv: [2, L, len(tokens), Hkv, D] computed at positions
        [0, len(tokens)), keys before RoPE with blend_store_pre_rope (another shape is a
        ValueError, before anything is stored). False if a piece of it went nowhere: no
        room in the hot cache, or its policy refused the piece and no tier below took it."""
        lay = self.layout
        want = (2, lay.num_layers, len(tokens), lay.num_kv_heads, lay.head_dim)
        if not tokens or tuple(kv.shape) != want:
            raise ValueError(f"a RAG chunk of {len(tokens)} tokens needs KV of shape {list(want)} "
                             f"[K/V, layers, tokens, KV heads, head dim], got {list(kv.shape)}")
        c = self.chunk_size
        keys = self.content_keys(tokens)
        for i, key in enumerate(keys):
            buf = self.allocate()
            if buf is None:
                return False
            try:
                part = kv[:, :, i * c : (i + 1) * c]
                buf.kv[:, :, : part.shape[2]].copy_(part)
                buf.kv[:, :, part.shape[2] :].zero_()
                buf.num_tokens = part.shape[2]  # a tail is stored at its own size below the hot cache
                buf.position = NO_POSITION if self.config.blend_store_pre_rope else i * c
                # a piece after the first is useful only with those before it (as fetched)
                if not self.store(key, buf, keys[i - 1] if i else None):
                    return False
            finally:
                buf.release()
        return True

    def blend_plan(self, tokens: list[int], separator: list[int]) -> BlendPlan | None:
        """Stored KV for the segments of a prompt split at ``separator``. The last segment
        (the query) is never looked up. None if no segment is stored."""
        plan = BlendPlan(recompute_ratio=self.config.blend_recompute_ratio,
                         check_layer=self.config.blend_check_layer,
                         pre_rope=self.config.blend_store_pre_rope)
        try:
            for seg in self._stored_segments(tokens, separator):
                keys = self.content_keys(tokens[seg.start : seg.end])
                pieces = self.fetch(keys)
                if len(pieces) < len(keys):
                    for buf in pieces:
                        buf.release()
                    continue
                plan.segments.append(CachedSegment(seg.start, seg.length, pieces))
        except Exception:  # a tier's read raised (failed and corrupt reads are misses)
            log.exception("lmkv: fetching a prompt's RAG chunks failed; computing it whole")
            self.count_error("connector", "blend")
            plan.release()
            return None
        return plan if plan.segments else None

    def segment_keys(self, tokens: list[int], separator: list[int]) -> list[list[str]]:
        """The content keys of each segment a blend may reuse (every non-empty one but the
        last, the query) of a prompt split at ``separator``."""
        return [self.content_keys(tokens[seg.start : seg.end])
                for seg in self._stored_segments(tokens, separator)]

    @staticmethod
    def _stored_segments(tokens: list[int], separator: list[int]) -> list:
        return [seg for seg in split_segments(tokens, separator)[:-1] if seg.length]

    def _serve_metrics(self):
        """lmkv's registry over HTTP on its own port: for engines whose /metrics lmkv cannot
        join (vLLM serves it from another process). A port in use is logged, not fatal."""
        from lmkv.metrics import serve_metrics

        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            server = serve_metrics(self.metrics.registry, host, port)
        except OSError as e:
            log.error("lmkv: cannot serve metrics on %s:%d (%s); lmkv metrics stay in-process "
                      "(config key metrics_port)", host, port, e)
            return None
        log.info("lmkv: metrics at http://%s:%d/metrics", host, port)
        return server

    def close(self) -> None:
        self.pins.clear()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self.storage.close()


def _tier(name: str, backend: StorageBackend, codec: str, table: CacheGenTable | None,
          metrics: LMKVMetrics) -> Tier:
    """A tier whose lossy codec falls back to zstd when there is no calibration table."""
    chosen = get_codec(codec)
    if chosen.lossy and table is None:
        chosen = get_codec("zstd")
    return Tier(name, backend, chosen, table if chosen.lossy else None, metrics)
