"""Calibrate the cachegen codec on a model's KV (``engine calibrate`` runs it with the
bundled engine).

The KV of calibration prompts, cut into lmkv's chunks (exactly what the codec will see),
is measured (calibration.calibrate) and the table is written where lmkv looks for it:
``cachegen_calibration`` if set, else the default path of the model's key scope
(calibration.default_path). chunk_size and cache_salt are part of the scope: calibrate
again after changing the model, chunk_size, dtype, tensor-parallel split or cache_salt.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cache import LMKVCache
from ..compute import KVComputer
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


def full_chunks(kv: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The full chunks of a sequence's KV [2, L, n, Hkv, D], each its own tensor."""
    return [kv[:, :, i * chunk : (i + 1) * chunk].clone() for i in range(kv.shape[2] // chunk)]


def calibrate_kv(computer: KVComputer, lmkv: LMKVCache, settings: CalibrationSettings,
                 prompts: list[list[int]], out: str | Path | None = None) -> tuple[CacheGenTable, Path]:
    """Measure the KV ``computer`` computes for ``prompts`` (their full chunks) and save the
    table; returns the table as lmkv will load it and where it went. Keys are measured
    before RoPE where the model rotates them (the table then codes keys un-rotated)."""
    c = lmkv.chunk_size
    rope = computer.rope_inv_freq
    chunks = []
    for kv in computer.compute_kv(prompts, pre_rope=rope is not None):  # [2, L, n, Hkv, D] each
        chunks += full_chunks(kv, c)
    if not chunks:
        raise ValueError(f"calibration prompts of {max(map(len, prompts), default=0)} tokens fill "
                         f"no chunk of {c}: make them longer")
    table = calibrate(chunks, settings, rope=rope)
    path = Path(out or lmkv.config.cachegen_calibration or default_path(lmkv.scope.prefix))
    table.save(path)
    return CacheGenTable.load(path), path
