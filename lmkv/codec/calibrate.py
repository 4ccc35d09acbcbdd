"""Calibrate the cachegen codec on a model's KV (``engine calibrate`` runs it with the
bundled engine).

The KV of calibration prompts, cut into lmkv's chunks (exactly what the codec will see),
is measured (calibration.calibrate) and the table is written where lmkv looks for it:
``cachegen_calibration`` if set, else the default path of the model's key scope
(calibration.default_path). chunk_size and cache_salt are part of the scope: calibrate
again after changing the model, chunk_size, dtype, tensor-parallel split or cache_salt.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..cache import LMKVCache
from ..compute import KVComputer
from .calibration import CacheGenTable, CalibrationSettings, calibrate, default_path

log = logging.getLogger(__name__)
MIN_TAIL = 16  # tokens a calibration prompt keeps past its stored chunks, to measure the output on


def calibration_prompts(vocab_size: int, num: int, length: int, seed: int = 0,
                        text: str | None = None, tokenize=None) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens: consecutive windows of ``text`` when given
    (best: text like the traffic the cache will see), else random token ids. Raises
    ValueError for text shorter than one prompt (it is not replaced by random ids unasked)."""
    if num < 1 or length < 1:
        raise ValueError(f"calibration needs at least one prompt of at least one token, got "
                         f"{num} prompt(s) of {length} token(s) (--prompts, --length)")
    if text is not None and tokenize is not None:
        ids = tokenize(text)
        windows = [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
        if not windows:
            raise ValueError(f"the calibration text is {len(ids)} tokens, shorter than one "
                             f"prompt of {length} (--text, --length)")
        if len(windows) < num:
            log.warning("the calibration text holds %d prompts of %d tokens, not %d: "
                        "calibrating on those", len(windows), length, num)
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
    longest = max(map(len, prompts), default=0)
    if settings.weigh_layers and longest < c + MIN_TAIL:  # refused before minutes of work
        raise ValueError(f"calibration prompts of {longest} tokens leave no {MIN_TAIL} tokens past a "
                         f"chunk of {c} to measure the layers' effect on: make them at least "
                         f"{c + MIN_TAIL} tokens (--length), or keep the ramp (--ramp; "
                         "weigh_layers=False in Python)")
    rope = computer.rope_inv_freq
    chunks = []
    for kv in computer.compute_kv(prompts, pre_rope=rope is not None):  # [2, L, n, Hkv, D] each
        chunks += full_chunks(kv, c)
    if not chunks:
        raise ValueError(f"calibration prompts of {longest} tokens fill no chunk of {c}: make them longer")
    table = calibrate(chunks, settings, rope=rope)
    if settings.weigh_layers:
        sensitivity = measure_sensitivity(computer, table, prompts, c)
        table = calibrate(chunks, settings, rope=rope, sensitivity=sensitivity)
    path = Path(out or lmkv.config.cachegen_calibration or default_path(lmkv.scope.prefix))
    table.save(path)
    return CacheGenTable.load(path), path


def measure_sensitivity(computer: KVComputer, table: CacheGenTable, prompts: list[list[int]],
                        chunk: int) -> torch.Tensor:
    """How much each [kv, layer]'s coding error moves the model's output: [2, L], the mean
    KL divergence (over the tokens after a prompt's stored chunks, and over ``prompts``) of
    the model's next-token distributions when that layer's K or V alone is replaced by its
    decoded copy under ``table``, per squared error target of that layer (the divergence
    of a small error grows with its square). ``CalibrationSettings.targets`` turns it into
    per-layer targets."""
    from .cachegen import OutOfRange, decode_into, encode

    two, layers = table.target.shape
    total = torch.zeros(two, layers, dtype=torch.float64)
    measured = 0
    for i, ids in enumerate(prompts):
        stored = (len(ids) - MIN_TAIL) // chunk * chunk
        if stored <= 0:
            continue
        prefix = computer.compute_kv([ids])[0][:, :, :stored]  # keys at their positions
        decoded = prefix.clone()
        for start in range(0, stored, chunk):
            part = prefix[:, :, start : start + chunk].contiguous()
            try:
                payload = encode(part, table, position=start)
            except OutOfRange:
                continue  # such a chunk is stored lossless: no error
            out = torch.empty_like(part)
            decode_into(payload, out, table)
            decoded[:, :, start : start + chunk] = out
        exact = torch.log_softmax(computer.continuation_logits(ids, prefix).double(), -1)
        mixed = prefix.clone()
        for kv in range(two):
            for layer in range(layers):
                mixed[kv, layer] = decoded[kv, layer]
                lossy = torch.log_softmax(computer.continuation_logits(ids, mixed).double(), -1)
                kl = (exact.exp() * (exact - lossy)).sum(-1).mean()
                total[kv, layer] += float(kl)
                mixed[kv, layer] = prefix[kv, layer]
        measured += 1
        log.info("cachegen calibration: layer sensitivity measured on %d of %d prompts",
                 i + 1, len(prompts))
    if not measured:
        raise ValueError(f"calibration prompts of {max(map(len, prompts), default=0)} tokens leave "
                         f"no {MIN_TAIL} tokens past a chunk of {chunk} to measure on: make them longer")
    return (total / measured / table.target.double().square()).float()
