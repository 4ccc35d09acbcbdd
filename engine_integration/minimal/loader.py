"""Load a Llama-family checkpoint from a Hugging Face directory (safetensors, mmap)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .model import LlamaForCausalLM
from .model_config import ModelConfig

log = logging.getLogger(__name__)


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, max_positions: int
) -> LlamaForCausalLM:
    """Build the model on the meta device and assign tensors read (mmap) from *.safetensors."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} has no *.safetensors weights")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    # the rotary tables are plain tensors, rebuilt on CPU
    model.model.rope = type(model.model.rope)(
        cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
    )
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name not in expected:
                    if "rotary_emb" not in name:
                        log.warning("ignoring unexpected weight %s in %s", name, path.name)
                    continue
                tensor = f.get_tensor(name)
                state[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {', '.join(missing[:5])}")
    for name, tensor in state.items():
        want = expected[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, config implies {tuple(want)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
