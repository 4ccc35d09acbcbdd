"""``engine export``: a model the engine loads (a GGUF file, the default SmolLM2) written as
a Hugging Face Llama directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so that other engines (vLLM, transformers) run the very same
weights and tokenizer: what lmkv's cross-engine benchmarks and tests compare."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .default_model import resolve_model
from .gguf_loader import GGUFCheckpoint, is_gguf
from .model_config import ModelConfig


def export_hf(model: str | None, out: str | Path, dtype: str = "float32") -> Path:
    """Write ``model`` (as ``engine --model`` names it) to ``out`` as an HF directory."""
    path = resolve_model(model)
    if not is_gguf(path):
        raise ValueError(f"{path} is already a checkpoint directory; nothing to export")
    with GGUFCheckpoint(path) as gguf:
        mc = gguf.model_config()
        # (the RoPE tables are not weights: one position will do)
        weights = gguf.load_model(mc, getattr(torch, dtype), 1).state_dict()
        tok = gguf.tokenizer()
    if mc.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_hf_config(mc, dtype), indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    # safetensors writes its file owner-only; readable as the other files (the umask's mode),
    # for an engine that runs as another user
    os.chmod(out / "model.safetensors", (out / "config.json").stat().st_mode & 0o777)
    tok._tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=2))
    return out


def _hf_config(mc: ModelConfig, dtype: str) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size, "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads, "num_key_value_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim, "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
        "max_position_embeddings": mc.max_position_embeddings,
        "tie_word_embeddings": mc.tie_word_embeddings, "torch_dtype": dtype,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": mc.bos_token_id,
        "eos_token_id": list(mc.eos_token_ids) if len(mc.eos_token_ids) != 1 else mc.eos_token_ids[0],
    }
    if mc.rope_scaling is not None:
        rs = mc.rope_scaling
        config["rope_scaling"] = (
            {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
             "high_freq_factor": rs.high_freq_factor,
             "original_max_position_embeddings": rs.original_max_position_embeddings}
            if rs.kind == "llama3" else {"rope_type": "linear", "factor": rs.factor})
    return config
