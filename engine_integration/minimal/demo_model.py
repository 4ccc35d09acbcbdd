"""Random-weight Llamas with a BPE tokenizer trained on Python's bundled documentation,
built deterministically offline and cached on disk (tests and shape benchmarks).

Their text is gibberish, but they exercise every code path of a real checkpoint
(safetensors, config.json, tokenizer.json) at any geometry. The model name "demo" picks
this one (default_model.py); the engine's default is SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lmkv.cc import cache_root

log = logging.getLogger(__name__)

DEMO_VERSION = 1
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]


@dataclass(frozen=True)
class DemoGeometry:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    init_std: float = 0.08  # wide enough that greedy choices are not near-ties
    seed: int = 0


def default_cache_dir() -> Path:
    return cache_root() / "models"


def ensure_demo_model(geometry: DemoGeometry | None = None, cache_dir: Path | None = None) -> Path:
    """Path of the demo model directory, building it on first use."""
    geometry = geometry or DemoGeometry()
    cache_dir = cache_dir or default_cache_dir()
    tag = "-".join(str(v) for v in asdict(geometry).values())
    path = cache_dir / f"demo-llama-v{DEMO_VERSION}-{_short_hash(tag)}"
    if (path / "model.safetensors").is_file():
        return path
    log.info("building the demo model in %s (first use only)", path)
    return build_atomically(path, lambda out: build_demo_model(out, geometry))


def build_atomically(path: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build`` into a temporary directory beside ``path`` and rename it into place, so
    a crash or a concurrent builder never leaves a half-written model at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    tmp.chmod(0o755)
    try:
        build(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            if not (path / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_demo_model(out_dir: Path, geometry: DemoGeometry) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(geometry.vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    g = geometry
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": g.vocab_size,
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": g.max_position_embeddings,
        "tie_word_embeddings": g.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "eos_token_id": tokenizer.token_to_id("<|eos|>"),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}, indent=2)
    )
    save_file(random_weights(g), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def random_weights(g: DemoGeometry) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(g.seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * g.init_std

    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    w = {"model.embed_tokens.weight": normal(g.vocab_size, g.hidden_size)}
    for i in range(g.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q, g.hidden_size)
        w[p + "self_attn.k_proj.weight"] = normal(kv, g.hidden_size)
        w[p + "self_attn.v_proj.weight"] = normal(kv, g.hidden_size)
        w[p + "self_attn.o_proj.weight"] = normal(g.hidden_size, q)
        w[p + "mlp.gate_proj.weight"] = normal(g.intermediate_size, g.hidden_size)
        w[p + "mlp.up_proj.weight"] = normal(g.intermediate_size, g.hidden_size)
        w[p + "mlp.down_proj.weight"] = normal(g.hidden_size, g.intermediate_size)
        w[p + "input_layernorm.weight"] = torch.ones(g.hidden_size)
        w[p + "post_attention_layernorm.weight"] = torch.ones(g.hidden_size)
    w["model.norm.weight"] = torch.ones(g.hidden_size)
    if not g.tie_word_embeddings:
        w["lm_head.weight"] = normal(g.vocab_size, g.hidden_size)
    return w


def train_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """Byte-level BPE trained on ``texts``, by default the documentation topics shipped
    with Python."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        topics = pydoc_data.topics.topics
        texts = [topics[k] for k in sorted(topics)]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _short_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:10]
