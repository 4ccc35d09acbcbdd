"""Random Llama checkpoints written by Hugging Face transformers (the reference)."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_hf_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0, init_std: float = 0.08, **cfg):
    """Build transformers' LlamaForCausalLM with random weights and save it (safetensors)
    next to the tokenizer from ``tokenizer_dir``. Returns the HF model (fp32, eval)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    defaults = dict(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, initializer_range=init_std, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )
    defaults.update(cfg)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**defaults)).eval()
    with torch.no_grad():  # norms start at 1: perturb them so they are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return model
