"""Which LMKVCache a vLLM engine's worker role builds: lmkv's config, the KV layout and
the model id, from vLLM's config and kv_connector_extra_config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmkv.config import ConfigError, LMKVConfig, load_config
from lmkv.layout import KVLayout
from lmkv.model_id import is_checkpoint, model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig


log = logging.getLogger(__name__)

_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer"}  # vLLM's kv_role -> lmkv's


@dataclass(frozen=True)
class EngineSpec:
    config: LMKVConfig
    layout: KVLayout
    model_id: str
    block_size: int  # vLLM's tokens per KV block
    tp_size: int = 1  # each tensor-parallel rank stores and loads its own shard (layout.rank)


def engine_spec(vllm_config: VllmConfig, extra: dict[str, Any]) -> EngineSpec:
    """lmkv's view of a vLLM engine. ``extra``: kv_connector_extra_config, lmkv config keys
    overriding the YAML/env settings; vLLM's kv_role kv_producer / kv_consumer sets lmkv's
    kv_role unless ``extra`` does. Raises ConfigError naming a bad key or setting."""
    role = _ROLES.get(getattr(vllm_config.kv_transfer_config, "kv_role", None))
    if role and "kv_role" not in extra:  # vLLM's producer/consumer roles carry over to lmkv
        extra = {**extra, "kv_role": role}
    clash = sorted({"path", "env"} & set(extra))  # load_config's own parameters
    if clash:
        raise ConfigError(f"unknown lmkv config key(s): {', '.join(clash)} (in kv_connector_extra_config)")
    config = load_config(**extra)
    if config.enable_blending:
        raise ConfigError("lmkv config key enable_blending is not supported inside vLLM (CacheBlend needs "
                          "the bundled engine's blended prefill); lmkv reuses prefixes here")
    if config.quality_check_every:
        raise ConfigError(
            "a lossy codec (cachegen) inside vLLM runs without lmkv's quality gate, which re-runs "
            "requests only in the bundled engine: set lmkv config key codec_check_every: 0 to serve "
            "lossy KV ungated, or keep the tiers lossless (local_disk_codec / remote_serde)")
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):  # (one latent vector per token: no K and V to page)
        raise ConfigError("lmkv's vLLM connector stores K and V per KV head; this model uses "
                          "multi-head latent attention (MLA), which it does not support")
    if getattr(mc, "is_hybrid", False) or getattr(mc, "is_attention_free", False):
        raise ConfigError("lmkv's vLLM connector stores attention KV; this model has "
                          "state-space (Mamba-like) layers, whose state it cannot store")
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is not None and getattr(sc, "uses_draft_kv_cache", lambda: False)():
        raise ConfigError(  # (its layers' KV would be neither stored nor loaded)
            f"lmkv's vLLM connector stores the target model's KV; speculative decoding with a "
            f"draft model that keeps KV of its own (method {sc.method!r}) is not supported "
            "(n-gram and suffix drafting are)")
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        log.warning("lmkv: vLLM's kv_load_failure_policy is %r: a chunk that fails to load fails "
                    "its request; set it to \"recompute\" in --kv-transfer-config to compute those "
                    "tokens instead", policy)
    pp = getattr(pc, "pipeline_parallel_size", 1)
    if pp > 1:
        raise ConfigError(f"lmkv's vLLM connector runs with pipeline_parallel_size 1 (got {pp}); "
                          "tensor parallelism is supported")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (cp := getattr(pc, name, 1) or 1) > 1:  # (each rank's pages hold a share of the tokens)
            raise ConfigError(f"lmkv's vLLM connector runs with {name} 1 (got {cp}): it stores "
                              "every token's KV on each rank")
    if cc.cache_dtype not in ("auto", None) and str(cc.cache_dtype) != str(mc.dtype).removeprefix("torch."):
        raise ConfigError(f"lmkv stores KV in the model dtype; vLLM kv_cache_dtype {cc.cache_dtype} "
                          "is not supported")
    block_size = cc.block_size
    if config.chunk_size % block_size:
        raise ConfigError(
            f"lmkv config key chunk_size {config.chunk_size} must be a multiple of vLLM's block "
            f"size {block_size} (set chunk_size, or vLLM's --block-size)")
    tp = getattr(pc, "tensor_parallel_size", 1) or 1
    # the split joins the keys: with fewer KV heads than ranks, rank r holds head r // (tp / H),
    # so rank 1 of TP=2 and rank 1 of TP=4 hold different heads in chunks of one shape
    layout = KVLayout(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), mc.dtype,
                      config.chunk_size, world_size=tp)
    load = getattr(vllm_config, "load_config", None)
    download_dir = getattr(load, "download_dir", None)
    weights = getattr(mc, "model_weights", None)  # (object storage: the weights lie there)
    ident = model_id(mc.model, mc.revision, _variant(mc, getattr(load, "load_format", None)),
                     download_dir, weights if weights and weights != mc.model else None)
    return EngineSpec(config, layout, ident, block_size, tp)


def model_id(model: str, revision: str | None = None, variant: str = "",
             download_dir: str | None = None, weights_uri: str | None = None) -> str:
    """A checkpoint is identified by its contents (the same id the bundled engine uses):
    a local checkpoint (a directory with its config or weights, or one file), or a hub
    name's snapshot in the local hub cache (``download_dir``, else the default one), which
    vLLM downloaded before the connector starts; a hub name with no snapshot there (another
    loader) by name and revision, with a warning: a branch name such as main names
    different weights once the repository moves. Weights streamed from object storage
    (``weights_uri``: only the config is local) are named by their URI, with a warning too.
    ``variant``, vLLM's settings that change the KV the same weights give, is added."""
    path: Path | None = Path(model)
    if not is_checkpoint(path):
        path = _hub_snapshot(model, revision, download_dir)
    if weights_uri is not None:
        config = model_fingerprint(path) if path is not None else f"hub:{model}"
        ident = f"uri:{weights_uri}|{config}"
        log.warning("lmkv: the weights stream from %s: its chunks are keyed by that URI, not by "
                    "the weights' bytes (new weights under it would be served old chunks)",
                    weights_uri)
    elif path is not None:
        ident = model_fingerprint(path)
    else:
        ident = f"hub:{model}@{revision or 'main'}"
    if path is None and not re.fullmatch(r"[0-9a-f]{40}", revision or ""):  # (a commit is fixed)
        log.warning("lmkv: no local snapshot of %s found in the hub cache: its chunks are keyed by "
                    "the name %s, not by its weights (new weights under that name would be "
                    "served old chunks): give vLLM a local directory or a commit as --revision",
                    model, ident)
    return f"{ident}|{variant}" if variant else ident


def _hub_snapshot(model: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The directory of ``model``'s snapshot at ``revision`` in the local hub cache, or None."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                      local_files_only=True))
    except Exception:  # (not there, not a hub name, no huggingface_hub)
        return None
    return path if (path / "config.json").is_file() else None


# load formats that read the checkpoint's own weights (others make them up, dummy, or read
# them from elsewhere: their name joins the key)
_OWN_WEIGHTS = {None, "auto", "safetensors", "pt", "npcache", "fastsafetensors", "mistral",
                "runai_streamer", "bitsandbytes", "gguf"}


def _variant(mc: Any, load_format: Any = None) -> str:
    """vLLM's settings that change the KV without changing the checkpoint's own files:
    quantization (the kernel vLLM picks: kernels round differently) and its config,
    hf_overrides (rope scaling, ...), a config read from elsewhere (hf_config_path), a load
    format that does not read the checkpoint's weights (dummy: random weights); "" when
    none is set."""
    parts = []
    load_format = getattr(load_format, "value", load_format)  # (an enum in some versions)
    if load_format not in _OWN_WEIGHTS:
        parts.append(f"load_format={load_format}")
    if quantization := getattr(mc, "quantization", None):
        parts.append(f"quantization={quantization}")
    if quantization_config := getattr(mc, "quantization_config", None):
        if dataclasses.is_dataclass(quantization_config):  # (vLLM's QuantizationConfigArgs)
            quantization_config = dataclasses.asdict(quantization_config)
        parts.append("quantization_config="
                     + json.dumps(quantization_config, sort_keys=True, default=str))
    config_path = getattr(mc, "hf_config_path", None)
    if config_path and config_path != mc.model:
        where = Path(config_path)
        where = where / "config.json" if where.is_dir() else where
        digest = (hashlib.blake2b(where.read_bytes(), digest_size=16).hexdigest()
                  if where.is_file() else config_path)
        parts.append(f"hf_config={digest}")
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):  # (the Python API's function form: named, its body is not seen)
        parts.append(f"hf_overrides={overrides.__module__}.{overrides.__qualname__}")
    elif overrides:
        parts.append(f"hf_overrides={json.dumps(overrides, sort_keys=True, default=str)}")
    return ";".join(parts)


def rank_config(config: LMKVConfig, tp_rank: int, tp_size: int, dp_rank: int = 0) -> LMKVConfig:
    """One worker rank's config: the ranks of an engine (and of its data-parallel copies)
    cannot share one metrics_port, so rank r of data-parallel rank d serves lmkv's metrics on
    metrics_port + d * tp_size + r (the scheduler's lookups are counted on tensor rank 0)."""
    offset = dp_rank * tp_size + tp_rank
    if not config.metrics_port or not offset:
        return config
    port = config.metrics_port + offset
    if port > 65535:
        raise ConfigError(f"lmkv config key metrics_port {config.metrics_port}: rank {offset} "
                          f"would serve on {port}, past 65535")
    return replace(config, metrics_port=port)
