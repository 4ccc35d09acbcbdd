"""``engine calibrate``: the cachegen codec's calibration table for a model, measured on
the KV the bundled engine computes (lmkv.codec.calibrate does the measuring)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lmkv.codec.calibrate import MIN_TAIL, calibrate_kv, calibration_prompts
from lmkv.codec.calibration import CacheGenTable, CalibrationSettings
from lmkv.config import LMKVConfig

from .llm import LLM


def calibrate_model(model: str | None, config: LMKVConfig, settings: CalibrationSettings,
                    num_prompts: int = 8, length: int | None = None, text: str | None = None,
                    out: str | Path | None = None, **engine_args) -> tuple[CacheGenTable, Path]:
    """Measure the model's KV and save its table; returns the table and where it went.
    ``config`` is the lmkv configuration the engine will serve with (its chunk_size and
    cache_salt name the table); no tier is written. Prompts of ``length`` tokens (default
    1024, or a chunk and the MIN_TAIL tokens measured after it where chunks are longer)."""
    if length is None:
        length = max(1024, config.chunk_size + MIN_TAIL)
    config = replace(config, local_disk=None, max_local_disk_size=0.0, remote_url=None,
                     local_cpu=True, local_disk_codec="raw", remote_serde="raw",
                     codec_check_every=0, max_local_cpu_size=min(config.max_local_cpu_size, 0.5))
    with LLM(model, lmkv_config=config, enable_prefix_caching=False, **engine_args) as llm:
        engine = llm.engine
        prompts = calibration_prompts(engine.model_config.vocab_size, num_prompts, length,
                                      text=text, tokenize=engine.tokenizer.encode)
        return calibrate_kv(engine, engine.kv_connector.cache, settings, prompts, out)
