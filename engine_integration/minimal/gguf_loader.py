"""Load a Llama-family GGUF file (llama.cpp's format, parsed by ``gguf_file``): the config
from ``llama.*`` metadata, weights dequantized at load to the engine's dtype with GGUF names
and llama.cpp's Q/K row order mapped to the engine's, and the tokenizer and chat template
from ``tokenizer.*`` metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_file import BLOCKS, GGUFFile, plain
from .model import LlamaForCausalLM
from .model_config import ModelConfig, RopeScaling
from .tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURE = "llama"  # llama.cpp writes Llama and Mistral checkpoints as "llama"
SUPPORTED_TYPES = tuple(BLOCKS)  # F32, F16, BF16, Q8_0, Q4_0, Q4_1

# GGUF tensor name -> the engine's (Hugging Face) name; "blk.{i}." becomes "model.layers.{i}."
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_MISSING = object()


def is_gguf(path: str | Path) -> bool:
    """True for an existing file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


class GGUFCheckpoint:
    """One GGUF file, its metadata parsed and its tensors memory-mapped. Raises ValueError
    naming what was found when the architecture or a tensor type is not supported."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = GGUFFile(self.path)
        except ValueError as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e
        arch = self.field("general.architecture", None)
        if arch != SUPPORTED_ARCHITECTURE:
            raise ValueError(f"GGUF file {self.path} holds architecture {arch!r}; this engine "
                             f"loads {SUPPORTED_ARCHITECTURE!r} (Llama-family) GGUF files")
        found = {t.type_name for t in self._file.tensors}
        unsupported = sorted(found - set(SUPPORTED_TYPES))
        if unsupported:
            raise ValueError(f"GGUF file {self.path} has tensors of type {', '.join(unsupported)}; "
                             f"this engine dequantizes {', '.join(SUPPORTED_TYPES)}")
        if "rope_freqs.weight" in {t.name for t in self._file.tensors}:
            raise ValueError(f"GGUF file {self.path} has per-frequency RoPE factors "
                             "(rope_freqs.weight), which this engine does not apply")

    def close(self) -> None:
        """Unmap the file (the dequantized weights are copies and stay)."""
        self._file.close()

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def field(self, key: str, default: Any = _MISSING, kind: type | None = None) -> Any:
        """One metadata value (strings decoded, arrays as lists); with ``kind`` (int, float,
        str, list) a value of another type is a ValueError naming the key."""
        if key not in self._file.fields:
            if default is _MISSING:
                raise ValueError(f"GGUF file {self.path} lacks metadata key {key}")
            return default
        value = plain(self._file.fields[key])
        if kind is not None and not _is(value, kind):
            raise ValueError(f"GGUF file {self.path}: metadata key {key} holds {_shown(value)}, "
                             f"not {_KIND_NAMES[kind]}")
        return value

    def model_config(self) -> ModelConfig:
        """The config from ``llama.*`` metadata, checked against the file's tensors."""
        a = SUPPORTED_ARCHITECTURE
        hidden = self.field(f"{a}.embedding_length", kind=int)
        num_heads = self.field(f"{a}.attention.head_count", kind=int)
        if num_heads < 1 or hidden < 1:
            raise ValueError(f"GGUF file {self.path}: {a}.embedding_length {hidden} and "
                             f"{a}.attention.head_count {num_heads} must be positive")
        names = {t.name for t in self._file.tensors}
        layers = self.field(f"{a}.block_count", kind=int)
        blocks = {int(n.split(".")[1]) for n in names
                  if n.startswith("blk.") and n.split(".")[1].isdigit()}
        if len(blocks) != layers or blocks != set(range(layers)):  # (the length first: a huge count)
            raise ValueError(f"GGUF file {self.path}: {a}.block_count is {layers}, its tensors "
                             f"hold {len(blocks)} blocks" + (f" (numbered up to {max(blocks)})"
                                                             if blocks else ""))
        tokens = self.field("tokenizer.ggml.tokens", None, list)
        vocab = self.field(f"{a}.vocab_size", None, int) or len(tokens or ())
        eos = tuple(i for k in ("eos", "eot", "eom")
                    if (i := self.field(f"tokenizer.ggml.{k}_token_id", None, int)) is not None)
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self.field(f"{a}.feed_forward_length", kind=int),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=self.field(f"{a}.attention.head_count_kv", None, int) or num_heads,
            head_dim=self.field(f"{a}.attention.key_length", None, int)
            or self.field(f"{a}.rope.dimension_count", None, int) or hidden // num_heads,
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5, float)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0, float)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self.field(f"{a}.context_length", 2048, int),
            tie_word_embeddings="output.weight" not in names,
            torch_dtype="float32",
            bos_token_id=self.field("tokenizer.ggml.bos_token_id", None, int),
            eos_token_ids=eos,
        )

    def _rope_scaling(self) -> RopeScaling | None:
        kind = self.field(f"{SUPPORTED_ARCHITECTURE}.rope.scaling.type", "none", str)
        if kind == "none":
            return None
        if kind == "linear":
            factor = float(self.field(f"{SUPPORTED_ARCHITECTURE}.rope.scaling.factor", kind=float))
            if not factor > 0:
                raise ValueError(f"GGUF file {self.path}: RoPE scaling factor {factor} is not "
                                 "positive")
            return RopeScaling(kind="linear", factor=factor)
        raise ValueError(f"GGUF file {self.path} has RoPE scaling {kind!r}; this engine "
                         "applies 'linear' scaling only")

    def tokenizer(self) -> Tokenizer:
        from .gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self.field, str(self.path))

    def load_model(self, cfg: ModelConfig, dtype: torch.dtype,
                   max_positions: int) -> LlamaForCausalLM:
        """The model with every tensor dequantized to ``dtype``."""
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, max_positions)
        model.model.rope = type(model.model.rope)(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        expected = dict(model.named_parameters())
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        state: dict[str, torch.Tensor] = {}
        for t in self._file.tensors:
            name = engine_name(t.name)
            if name not in expected:
                raise ValueError(f"GGUF file {self.path} has tensor {t.name}, which a Llama "
                                 f"with this config does not have")
            w = self._file.dequantize(t)  # [out, in] or [n] as the engine's layout
            if t.name.endswith(".attn_q.weight"):
                w = unpermute_rows(w, cfg.num_heads)
            elif t.name.endswith(".attn_k.weight"):
                w = unpermute_rows(w, cfg.num_kv_heads)
            want = tuple(expected[name].shape)
            if w.shape != want:
                raise ValueError(f"GGUF tensor {t.name} has shape {w.shape}, config implies {want}")
            state[name] = torch.from_numpy(w).to(dtype)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"GGUF file {self.path} lacks weights: {', '.join(missing[:5])}")
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()


def engine_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return gguf_name


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Each head's rows [0, D) are stored interleaved as
    pairs (rotated-as-complex layout); the engine's RoPE rotates halves (rows [0, D/2) with
    [D/2, D)), so row 2j+i of a head goes back to row i*D/2 + j."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", list: "an array"}


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__} of {len(value)} items"
