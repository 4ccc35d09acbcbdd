"""CacheGenTable: the per-model quantization table of the cachegen codec, measured on the
model's own KV, and stored as a safetensors file (tensors + string metadata; never pickled).

Calibration (``calibrate``) looks at chunks of real KV [2, L, T, Hkv, D]:
- ``mean`` [2, L, Hkv, D]: each channel's mean, removed before quantizing (keys carry large
  constant channel offsets);
- ``step`` [2, L, Hkv, D]: the quantization step. A uniform step s leaves an error of rms
  s / sqrt(12), so s = error(kv, layer) * sqrt(12) * rms of the centred KV of that layer
  gives a relative error of about error(kv, layer). The error target moves linearly from
  ``error`` at layer 0 to ``error * deep_ratio`` at the last layer (above 1: deep layers
  coarser; below 1: finer), times ``value_ratio`` for V; or, where each layer's effect on
  the model's output was measured (``sensitivity``), each layer gets the target that makes
  its share of the output's divergence equal to every other's, for the ramp's total;
- ``delta`` [2, L] bool: code each token as its difference from the group's first token
  (the anchor) where that lowers the measured entropy of the symbols (KV of neighbouring
  tokens is similar in trained models; in random ones it is not, and the flag stays off).
- with ``transform`` (the default), a decorrelating transform per [kv, layer]: ``basis``
  [2, L, C, C] (C = Hkv * D), the eigenvectors of the covariance of the token vectors,
  strongest first. Tokens are coded as their coefficients in it (``mean`` and ``step`` then
  hold the coefficients' mean and step); for a near-Gaussian KV, an orthonormal transform
  keeps the error and concentrates the variance in few coefficients, so equal steps cost
  fewer bits. ``bands`` [2, L, B + 1] int32 splits the coefficients, by their spread in
  steps, into runs entropy-coded apart; coefficients past ``bands[..., -1]`` are not stored
  (with ``store_weak`` off: those whose spread is below half a step; on, the default,
  every coefficient is stored: dropping them cost QA accuracy on SmolLM2, docs/codec.md).
- with ``rope`` (the model's rotary inverse frequencies, [D/2]; given when the calibration
  chunks hold keys before RoPE), keys are measured and coded as if at position 0: the codec
  un-rotates a chunk's keys by their positions before coding and rotates them back after
  decoding (the position is in the payload), so the statistics hold at every position
  instead of being smeared over the positions seen in calibration.

The table id (xxh3-64 of the file's bytes) is written into every payload; a payload made
with another table is rejected rather than decoded wrongly.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from lmkv.cc import cache_root

log = logging.getLogger(__name__)

QMAX = 16383  # |symbol| < QMAX (cachegen.encode refuses a chunk beyond it)
RANGE_HEADROOM = 2  # calibration's largest value may take half of that: unseen chunks go further
FORMAT = "lmkv-cachegen-table/3"
FORMATS = ("lmkv-cachegen-table/1", "lmkv-cachegen-table/2", FORMAT)  # /1: no transform; /2: no rope
# band edges in coefficient spread / step, strongest first; the coefficients below the last
# edge form one more band (store_weak, the default) or are not stored
BAND_SPREADS = (64.0, 16.0, 4.0, 1.0, 0.5)
MAX_TARGET = 1.0  # coarsest relative error a layer is given (at 1/sqrt(12) a step is the rms)


@dataclass(frozen=True)
class CalibrationSettings:
    error: float = 0.12  # relative error target of layer 0 (keys); docs/codec.md "Numbers"
    deep_ratio: float = 0.5  # the last layer's target is error * deep_ratio
    value_ratio: float = 0.5  # V's target relative to K's
    group_size: int = 16  # tokens per anchor group
    transform: bool = True  # decorrelating transform per [kv, layer] (see above)
    store_weak: bool = True  # also store coefficients whose spread is below half a step
    weigh_layers: bool = True  # targets from each layer's measured effect (where measured)

    def __post_init__(self) -> None:
        if not (0 < self.error < 1 and self.deep_ratio > 0 and self.value_ratio > 0):
            raise ValueError(f"bad calibration settings {self}")
        if not 1 <= self.group_size <= 1024:
            raise ValueError(f"group_size {self.group_size} outside [1, 1024]")

    def targets(self, num_layers: int, sensitivity: torch.Tensor | None = None) -> torch.Tensor:
        """Relative error target per [kv, layer]: [2, L] float32. Without ``sensitivity``, a
        ramp from ``error`` (layer 0's keys) to ``error * deep_ratio`` (the last layer's),
        times ``value_ratio`` for V. With it ([2, L]: the model's output divergence per
        squared target of each [kv, layer] alone, see codec/calibrate.py), the targets that
        spread the ramp's predicted divergence evenly over the layers: each layer's error
        then costs the answers alike, so insensitive layers take coarse steps (fewer bits)
        and sensitive ones fine steps, for about the ramp's divergence in total."""
        ramp = torch.linspace(0, 1, num_layers) if num_layers > 1 else torch.zeros(1)
        k = self.error * (1 + (self.deep_ratio - 1) * ramp)
        targets = torch.stack([k, k * self.value_ratio]).float()
        if sensitivity is None or not self.weigh_layers:
            return targets
        s = sensitivity.double().clamp_min(0)
        if tuple(s.shape) != tuple(targets.shape):
            raise ValueError(f"sensitivity {tuple(s.shape)} does not fit {num_layers} layers")
        if not bool(torch.isfinite(s).all()):
            raise ValueError("sensitivity has NaN or infinite values (the model's logits overflowed?)")
        if not bool((s > 0).any()):
            return targets  # nothing measured moved the output: keep the ramp
        # minimise bits (sum of -log target) at the ramp's divergence sum(s * target^2):
        # s * target^2 equal in every layer
        each = (s * targets.double().square()).sum() / s.numel()
        even = (each / s.clamp_min(1e-30)).sqrt()
        return even.clamp(max=MAX_TARGET).float()


@dataclass(frozen=True, eq=False)
class CacheGenTable:
    step: torch.Tensor  # [2, L, Hkv, D] float32, > 0
    mean: torch.Tensor  # [2, L, Hkv, D] float32
    delta: torch.Tensor  # [2, L] bool
    target: torch.Tensor  # [2, L] float32: the relative error each layer was calibrated to
    group_size: int
    table_id: int  # xxh3-64 of the serialized table
    basis: torch.Tensor | None = None  # [2, L, C, C] float32, columns orthonormal
    bands: torch.Tensor | None = None  # [2, L, B + 1] int32 coefficient band edges
    rope: torch.Tensor | None = None  # [D/2] float32: keys coded un-rotated (see above)

    @functools.cached_property
    def scratch(self):  # -> cachegen.DecodeScratch (imported late: cachegen imports this)
        from .cachegen import DecodeScratch

        return DecodeScratch()

    @property
    def num_layers(self) -> int:
        return self.step.shape[1]

    @functools.cached_property
    def synthesis(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For decoding with the transform: [2L, C, C] rows = step * basis^T (fp32 and
        bfloat16), and [2L, C] the KV of all coefficients at their mean, so that
        kv = symbols @ rows + offset."""
        two, layers, h, d = self.step.shape
        basis_t = self.basis.reshape(two * layers, h * d, h * d).transpose(1, 2)
        step = self.step.reshape(two * layers, h * d, 1)
        mean = self.mean.reshape(two * layers, 1, h * d)
        rows = (step * basis_t).contiguous()
        return rows, rows.to(torch.bfloat16), (mean @ basis_t).squeeze(1)

    def check_layout(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError unless chunks of ``shape`` [2, L, T, H, D] fit this table."""
        _, layers, _, heads, dim = shape
        if tuple(self.step.shape) != (2, layers, heads, dim):
            raise ValueError(f"calibration table for [2, L, H, D] = {tuple(self.step.shape)} "
                             f"does not fit chunks {tuple(shape)}")

    def to_bytes(self) -> bytes:
        return _serialize(self.step, self.mean, self.delta, self.target, self.group_size,
                          self.basis, self.bands, self.rope)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(path)

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheGenTable:
        from safetensors.torch import load

        try:
            tensors = load(data)
            meta = json.loads(_metadata(data).get("lmkv", "{}"))
            if not isinstance(meta, dict):
                raise ValueError("its lmkv metadata is not a JSON object")
            step, mean = tensors["step"].float(), tensors["mean"].float()
            delta, target = tensors["delta"].bool(), tensors["target"].float()
            group_size = meta.get("group_size")
        except Exception as e:  # safetensors raises its own error types; a tensor may be missing
            raise ValueError(f"not a cachegen calibration table: {e!r}") from e
        if meta.get("format") not in FORMATS:
            raise ValueError(f"calibration table format {meta.get('format')!r}, expected one "
                             f"of {FORMATS}")
        if not isinstance(group_size, int) or not 1 <= group_size <= 1024:
            raise ValueError(f"calibration table group_size {group_size!r} outside [1, 1024]")
        if (step.dim() != 4 or step.shape[0] != 2 or mean.shape != step.shape
                or delta.shape != step.shape[:2] or target.shape != step.shape[:2]
                or not bool(((step > 0) & torch.isfinite(step)).all())
                or not bool(torch.isfinite(mean).all()) or not bool(torch.isfinite(target).all())):
            raise ValueError("calibration table has inconsistent tensors")
        basis, bands = tensors.get("basis"), tensors.get("bands")
        if (basis is None) != (bands is None):
            raise ValueError("calibration table has a transform basis without bands or back")
        if basis is not None:
            basis, bands = basis.float(), bands.to(torch.int32)
            c = step.shape[2] * step.shape[3]
            if (tuple(basis.shape) != (*step.shape[:2], c, c) or bands.dim() != 3
                    or bands.shape[:2] != step.shape[:2] or bands.shape[2] < 2
                    or not bool(torch.isfinite(basis).all()) or bool((bands[..., 0] != 0).any())
                    or bool((bands.diff(dim=2) < 0).any()) or bool((bands[..., -1] > c).any())):
                raise ValueError("calibration table has an inconsistent transform")
            if bool(delta.any()):  # transform payloads code no anchor deltas
                raise ValueError("calibration table has a transform and anchor deltas")
            if bool(((basis.square().sum(dim=-1) - 1).abs() > 1e-3).any()):  # (rows of unit norm)
                raise ValueError("calibration table has a transform basis that is not orthonormal")
        # a decoded value (a symbol of at most 2^15 steps, summed over the basis, plus the
        # mean) must stay far from float32's range: a table that passed the checks above
        # could otherwise decode every chunk to inf or NaN
        spread = math.sqrt(step.shape[2] * step.shape[3]) if basis is not None else 1.0
        if float(step.amax()) * 32768 * spread + float(mean.abs().amax()) > 1e30:
            raise ValueError("calibration table has steps or means too large to decode")
        rope = tensors.get("rope_inv_freq")
        if (rope is not None) != (meta.get("format") == FORMAT):
            raise ValueError(f"calibration table of format {meta.get('format')} "
                             f"{'with' if rope is not None else 'without'} rotary frequencies")
        if rope is not None:
            rope = rope.float()
            if (tuple(rope.shape) != (step.shape[3] // 2,) or step.shape[3] % 2
                    or not bool(torch.isfinite(rope).all())):
                raise ValueError(f"calibration table has rotary frequencies of shape "
                                 f"{tuple(rope.shape)} for head_dim {step.shape[3]}")
        return cls(step, mean, delta, target, group_size,
                   xxhash.xxh3_64_intdigest(data), basis, bands, rope)

    @classmethod
    def load(cls, path: str | Path) -> CacheGenTable:
        return cls.from_bytes(Path(path).read_bytes())


def default_path(scope_prefix: str) -> Path:
    """Where the table of a key scope (``KeyScope.prefix``: model, layout, rank, namespace)
    lives unless ``cachegen_calibration`` names a file: one file per scope, so a table is
    only ever used for the KV it was measured on."""
    name = scope_prefix.replace("@", "_").replace("/", "_")
    return cache_root() / "calibration" / f"{name}.safetensors"


def _serialize(step, mean, delta, target, group_size: int, basis=None, bands=None,
               rope=None) -> bytes:
    from safetensors.torch import save

    tensors = {"step": step.float().contiguous(), "mean": mean.float().contiguous(),
               "delta": delta.to(torch.uint8).contiguous(), "target": target.float().contiguous()}
    if basis is not None:
        tensors |= {"basis": basis.float().contiguous(), "bands": bands.to(torch.int32).contiguous()}
    if rope is not None:
        tensors["rope_inv_freq"] = rope.float().contiguous()
    fmt = FORMAT if rope is not None else FORMATS[1] if basis is not None else FORMATS[0]
    meta = {"lmkv": json.dumps({"format": fmt, "group_size": group_size})}
    return save(tensors, metadata=meta)


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {})


def build_table(step, mean, delta, target, group_size: int, basis=None, bands=None, rope=None
                ) -> CacheGenTable:
    data = _serialize(step, mean, delta, target, group_size, basis, bands, rope)
    return CacheGenTable.from_bytes(data)


def calibrate(chunks: Iterable[torch.Tensor], settings: CalibrationSettings | None = None,
              rope: torch.Tensor | None = None, sensitivity: torch.Tensor | None = None
              ) -> CacheGenTable:
    """The table for the model whose KV chunks [2, L, T, Hkv, D] are given (a few dozen
    chunks of ordinary prompts are enough). With ``rope``, the model's rotary inverse
    frequencies [D/2], the chunks' keys are before RoPE (``KVComputer.compute_kv(...,
    pre_rope=True)``) and the table codes keys un-rotated (module docstring). With
    ``sensitivity`` [2, L], the targets weigh the layers (``CalibrationSettings.targets``)."""
    settings = settings or CalibrationSettings()
    chunks = list(chunks)
    data = torch.cat([c.float() for c in chunks], dim=2)  # [2, L, N, H, D]
    if data.shape[2] == 0:
        raise ValueError("calibration needs at least one chunk")
    mean = data.mean(dim=2)  # [2, L, H, D]
    centred = data - mean[:, :, None]
    rms = centred.square().mean(dim=(2, 3, 4)).sqrt().clamp_min(1e-12)  # [2, L]
    axes = _principal_axes(centred) if settings.transform else None
    target = _within_range(centred, rms, settings.targets(data.shape[1], sensitivity), axes)
    step = (target * math.sqrt(12) * rms)[:, :, None, None].expand_as(mean).contiguous()
    q = torch.round(centred / step[:, :, None]).clamp(-QMAX, QMAX)
    g = settings.group_size
    anchors = q[:, :, (torch.arange(q.shape[2]) // g) * g]
    delta = torch.zeros(q.shape[:2], dtype=torch.bool)
    for kv in range(2):
        for layer in range(q.shape[1]):
            plain = _entropy(q[kv, layer])
            diff = _entropy(q[kv, layer] - anchors[kv, layer])
            delta[kv, layer] = diff < plain
    table = build_table(step, mean, delta, target, g, rope=rope)
    if not settings.transform:
        return table
    # the transform where it pays: not on KV with no correlations to remove
    from ..memory import NO_POSITION
    from .cachegen import encode

    transformed = _calibrate_transform(axes, mean, step, target, g, settings.store_weak, rope)
    size = lambda t: sum(len(encode(c, t, position=NO_POSITION)) for c in chunks)  # noqa: E731
    return transformed if size(transformed) < size(table) else table


def _entropy(symbols: torch.Tensor) -> float:
    """Empirical entropy in bits per symbol."""
    _, counts = np.unique(symbols.numpy().astype(np.int32), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _principal_axes(centred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per [kv, layer], the variances [2, L, C] and orthonormal axes [2, L, C, C] (columns)
    of the token vectors, strongest first."""
    two, layers, n, heads, dim = centred.shape
    x = centred.reshape(two, layers, n, heads * dim).double()
    cov = x.transpose(2, 3) @ x / n  # [2, L, C, C]
    var, vec = torch.linalg.eigh(cov)  # ascending
    return var.flip(-1).clamp_min(0), vec.flip(-1).float()


def _within_range(centred: torch.Tensor, rms: torch.Tensor, target: torch.Tensor,
                  axes: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``target`` [2, L], raised (with a warning) where its step would put the calibration
    KV's largest value (per channel, or per coefficient on ``axes``) beyond 1/RANGE_HEADROOM
    of the symbol range: a finer step cannot code this model's KV."""
    two, layers, n, heads, dim = centred.shape
    peak = centred.abs().amax(dim=(2, 3, 4))
    if axes is not None:
        coef = centred.reshape(two, layers, n, heads * dim) @ axes[1]
        peak = torch.maximum(peak, coef.abs().amax(dim=(2, 3)))
    finest = (peak * RANGE_HEADROOM / QMAX / (math.sqrt(12) * rms)).float()
    low = target < finest
    if bool(low.any()):
        where = ", ".join(f"{'KV'[kv]}{layer} {finest[kv, layer]:.2g}"
                          for kv, layer in low.nonzero().tolist())
        log.warning("cachegen calibration: the error target is finer than the KV's range allows "
                    "in %d (kv, layer)s; their targets are raised to: %s", int(low.sum()), where)
    return torch.maximum(target, finest)


def _calibrate_transform(axes: tuple[torch.Tensor, torch.Tensor], mean: torch.Tensor,
                         step: torch.Tensor, target: torch.Tensor, group_size: int,
                         store_weak: bool, rope: torch.Tensor | None = None) -> CacheGenTable:
    """The table with a decorrelating transform (see the module docstring)."""
    two, layers = step.shape[:2]
    var, basis = axes
    spread = var.sqrt().float() / step.reshape(two, layers, -1)  # std in steps per coefficient
    edges = torch.tensor((float("inf"), *BAND_SPREADS, *((0.0,) if store_weak else ())))
    # coefficients are sorted by spread, so each band is a run: its end = how many reach it
    bands = (spread[..., None] >= edges[1:]).sum(dim=2).to(torch.int32)  # [2, L, B]
    bands = torch.cat([torch.zeros_like(bands[..., :1]), bands], dim=2)
    coef_mean = (mean.reshape(two, layers, 1, -1) @ basis).reshape_as(mean)
    delta = torch.zeros(two, layers, dtype=torch.bool)
    return build_table(step, coef_mean, delta, target, group_size, basis, bands, rope)
