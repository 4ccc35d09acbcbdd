"""The model's geometry, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use one of float32, bfloat16, float16") from None


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ('llama3'), or linear position interpolation."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, value, most in (("vocab_size", self.vocab_size, 1 << 24),
                                  ("hidden_size", self.hidden_size, 1 << 17),
                                  ("intermediate_size", self.intermediate_size, 1 << 20),
                                  ("num_hidden_layers", self.num_layers, 1 << 12),
                                  ("num_attention_heads", self.num_heads, 1 << 12),
                                  ("num_key_value_heads", self.num_kv_heads, 1 << 12),
                                  ("head_dim", self.head_dim, 1 << 10),
                                  ("max_position_embeddings", self.max_position_embeddings, 1 << 30)):
            if type(value) is not int or not 1 <= value <= most:  # noqa: E721 - bool is no size
                raise ValueError(f"model config {name} is {value!r}: expected a whole number "
                                 f"in [1, {most}]")
        for name, value in (("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)):
            if not isinstance(value, int | float) or isinstance(value, bool) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"model config {name} is {value!r}: expected a positive number")
        ids = (self.bos_token_id, *self.eos_token_ids)
        if any(i is not None and (type(i) is not int or not 0 <= i < self.vocab_size)  # noqa: E721
               for i in ids):
            raise ValueError(f"model config token ids {ids} must lie in [0, vocab_size "
                             f"{self.vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; this engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family) models"
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = raw.get("rope_parameters") or {}
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=_parse_rope_scaling(raw.get("rope_scaling") or rope_params),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _parse_rope_scaling(raw: dict | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")
