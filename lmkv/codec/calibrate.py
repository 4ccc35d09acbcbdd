"""Calibrate the cachegen codec for a model: python -m lmkv.codec.calibrate --model DIR.

Runs calibration prompts through the bundled engine with lmkv on, takes the chunks lmkv
stored (exactly the KV the codec will see), measures them (calibration.calibrate) and
writes the table where lmkv looks for it: ``cachegen_calibration`` if set, else the
default path of the model's key scope (calibration.default_path). It reads the lmkv
configuration as the engine does (LMKV_CONFIG_FILE, LMKV_* variables), so run it with the
engine's: chunk_size and cache_salt are part of the scope. Calibrate again after changing
the model, chunk_size, dtype, tensor-parallel split or cache_salt.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

import torch

from ..config import LMKVConfig, load_config
from .calibration import CacheGenTable, CalibrationSettings, calibrate, default_path


def calibration_prompts(vocab_size: int, num: int, length: int, seed: int = 0,
                        text: str | None = None, tokenize=None) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens: consecutive windows of ``text`` when given
    (best: text like the traffic the cache will see), else random token ids."""
    if text is not None and tokenize is not None:
        ids = tokenize(text)
        windows = [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
        if windows:
            return windows[:num]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (length,), generator=g).tolist() for _ in range(num)]


def calibrate_model(model_dir: str | None, config: LMKVConfig, settings: CalibrationSettings,
                    num_prompts: int = 8, length: int = 1024, text: str | None = None,
                    out: str | Path | None = None, **engine_args) -> tuple[CacheGenTable, Path]:
    """Measure the model's KV and save its table; returns the table and where it went."""
    from lmkv_engines.minimal.llm import LLM
    from lmkv_engines.minimal.sampling_params import SamplingParams

    # hot cache only, big enough for one prompt's chunks (they are copied out after each)
    config = replace(config, local_disk=None, max_local_disk_size=0.0, remote_url=None,
                     local_disk_codec="raw", remote_serde="naive", codec_check_every=0,
                     max_local_cpu_size=min(config.max_local_cpu_size, 2.0))
    llm = LLM(model_dir, lmkv_config=config, enable_prefix_caching=False, **engine_args)
    try:
        engine = llm.engine.kv_connector.engine
        prompts = calibration_prompts(llm.engine.model_config.vocab_size, num_prompts, length,
                                      text=text, tokenize=llm.engine.tokenizer.encode)
        chunks = []
        for p in prompts:
            llm.generate([p], SamplingParams(max_tokens=1, temperature=0))
            for buf in engine.fetch(engine.keys(p)):
                chunks.append(buf.kv.clone())
                buf.release()
        if not chunks:
            raise ValueError(f"calibration prompts of {length} tokens fill no chunk of "
                             f"{config.chunk_size}: raise --length")
        table = calibrate(chunks, settings)
        path = Path(out or config.cachegen_calibration or default_path(engine.scope.prefix))
        table.save(path)
        return CacheGenTable.load(path), path
    finally:
        llm.engine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lmkv.codec.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the bundled demo model)")
    ap.add_argument("--out", help="table file (default: cachegen_calibration, else per scope)")
    ap.add_argument("--prompts", type=int, default=8, help="calibration prompts")
    ap.add_argument("--length", type=int, default=1024, help="tokens per prompt")
    ap.add_argument("--text", help="a text file to cut prompts from (default: random tokens)")
    defaults = CalibrationSettings()
    ap.add_argument("--error", type=float, default=defaults.error,
                    help="relative error target of layer 0")
    ap.add_argument("--deep-ratio", type=float, default=defaults.deep_ratio,
                    help="last layer's target / first layer's")
    ap.add_argument("--value-ratio", type=float, default=defaults.value_ratio,
                    help="V's target / K's")
    ap.add_argument("--group-size", type=int, default=defaults.group_size,
                    help="tokens per delta group")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = CalibrationSettings(args.error, args.deep_ratio, args.value_ratio, args.group_size)
    text = Path(args.text).read_text() if args.text else None
    table, path = calibrate_model(args.model, load_config(), settings, args.prompts,
                                  args.length, text, args.out)
    print(f"cachegen table {table.table_id:016x} -> {path}")
    print("delta coding per layer (K):", table.delta[0].int().tolist(),
          "(V):", table.delta[1].int().tolist())


if __name__ == "__main__":
    main()
