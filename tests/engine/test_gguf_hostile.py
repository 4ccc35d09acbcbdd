"""GGUF files whose metadata is wrong (bad types, sizes past any model, ids outside the
vocabulary, a tokenizer that cannot be built, a chat template that is not text): the engine
refuses each with a ValueError naming what was wrong, before it allocates for it."""

from __future__ import annotations

import numpy as np
import pytest

from lmkv_engines.minimal.llm import LLM

from .test_gguf_types import _byte_tokens

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM = 32, 64, 2, 2, 16


def _write(path, **overrides):
    """A tiny Llama GGUF (F32 tensors); ``overrides``: metadata key -> (GGUFWriter's add_
    method suffix, value), None to leave the key out."""
    tokens = _byte_tokens() + ["\u0120t", "<s>", "</s>"]
    meta = {
        "llama.block_count": ("uint32", LAYERS), "llama.context_length": ("uint32", 512),
        "llama.embedding_length": ("uint32", HIDDEN), "llama.feed_forward_length": ("uint32", FFN),
        "llama.attention.head_count": ("uint32", HEADS),
        "llama.attention.head_count_kv": ("uint32", HEADS),
        "llama.rope.freq_base": ("float32", 10000.0),
        "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-5),
        "tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "gpt2"),
        "tokenizer.ggml.tokens": ("array", tokens),
        "tokenizer.ggml.token_type": ("array", [1] * 257 + [3, 3]),
        "tokenizer.ggml.merges": ("array", ["\u0120 t"]),
        "tokenizer.ggml.bos_token_id": ("uint32", 257), "tokenizer.ggml.eos_token_id": ("uint32", 258),
    }
    meta.update(overrides)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, spec in meta.items():
        if spec is not None:
            getattr(w, f"add_{spec[0]}")(key, spec[1])
    rng = np.random.default_rng(0)

    def put(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    put("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        qkv = (HEADS * HEAD_DIM, HIDDEN)
        for kind, shape in (("attn_q", qkv), ("attn_k", qkv), ("attn_v", qkv),
                            ("attn_output", (HIDDEN, HEADS * HEAD_DIM)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN)),
                            ("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,))):
            put(f"blk.{i}.{kind}.weight", *shape)
    put("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_tiny_file_loads(tmp_path):
    llm = LLM(str(_write(tmp_path / "ok.gguf")), kv_cache_memory=4 << 20)
    assert llm.engine.model_config.num_layers == LAYERS


@pytest.mark.parametrize("override, want", [
    ({"llama.block_count": ("uint32", 1 << 31)}, "block_count is 2147483648, its tensors hold 2 blocks"),
    ({"llama.block_count": ("uint32", 1)}, "block_count is 1"),
    ({"llama.attention.head_count": ("uint32", 0)}, "head_count 0 must be positive"),
    ({"llama.embedding_length": ("string", "32")}, "embedding_length holds '32', not an integer"),
    ({"llama.attention.head_count": ("array", [2, 2])}, "head_count holds .*not an integer"),
    ({"llama.rope.freq_base": ("array", [1.0])}, "freq_base holds .*not a number"),
    ({"llama.context_length": ("uint64", 1 << 40)}, "max_position_embeddings is 1099511627776"),
    ({"llama.attention.key_length": ("uint32", 1 << 28)}, "head_dim is 268435456"),
    ({"llama.attention.layer_norm_rms_epsilon": ("float32", -1.0)}, "rms_norm_eps is -1.0"),
    ({"tokenizer.ggml.bos_token_id": ("uint32", 9999)}, r"token ids \(9999, 258\) must lie in \[0,"),
    ({"tokenizer.ggml.eos_token_id": ("int32", -1)}, r"token ids \(257, -1\)"),
    ({"tokenizer.ggml.bos_token_id": ("float32", 1.0)}, "bos_token_id holds 1.0, not an integer"),
    ({"tokenizer.ggml.merges": ("array", ["a zz"])}, "tokenizer cannot be built"),
    ({"tokenizer.ggml.merges": ("array", ["ab"])}, "merges two tokens joined by a space"),
    ({"tokenizer.ggml.tokens": ("array", list(range(259)))}, "tokens must be strings"),
    ({"tokenizer.ggml.token_type": ("array", [1, 1])}, "token_type one per token"),
    ({"tokenizer.chat_template": ("uint32", 5)}, "chat_template holds 5, not a string"),
])  # fmt: skip
def test_bad_metadata_is_refused_naming_it(tmp_path, override, want):
    path = _write(tmp_path / "bad.gguf", **override)
    with pytest.raises(ValueError, match=want):
        LLM(str(path), kv_cache_memory=4 << 20)


def test_the_tokenizer_checks_its_own_ids(tmp_path):
    """(The engine's config refuses these first; the tokenizer alone does too.)"""
    from lmkv_engines.minimal.gguf_loader import GGUFCheckpoint

    path = _write(tmp_path / "bad.gguf", **{"tokenizer.ggml.eos_token_id": ("uint32", 259)})
    with GGUFCheckpoint(path) as ckpt, pytest.raises(ValueError, match="eos_token_id 259 is not among"):
        ckpt.tokenizer()


def test_a_chat_template_that_fails_is_a_value_error_and_transformers_filters_work():
    from lmkv_engines.minimal.tokenizer import Tokenizer

    def with_template(text):
        tok = object.__new__(Tokenizer)
        tok.chat_template, tok.bos_token, tok.eos_token = text, "<s>", "</s>"
        return tok

    msgs = [{"role": "user", "content": "hé"}]
    out = with_template("{{ messages | tojson(ensure_ascii=True, sort_keys=True, indent=1) }}"
                        "{{ strftime_now('%Y') }}").apply_chat_template(msgs)
    assert '"h\\u00e9"' in out and out.endswith(str(__import__("datetime").date.today().year))
    with pytest.raises(ValueError, match="chat template failed"):
        with_template("{{ messages[0]['content'] + 1 }}").apply_chat_template(msgs)
