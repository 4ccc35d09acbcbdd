"""Every GGUF tensor type the engine reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1), an untied
output matrix and llama.cpp's Q/K row order, in a tiny Llama GGUF written here: the engine's
weights equal the values the file encodes and its logits equal transformers' on the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

from .test_model_vs_hf import _engine_logits

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 2, 1, 32
# per tensor kind, the type each layer stores it in: every type appears, quantized Q and K too
TYPES = {
    "attn_q": ("Q4_0", "Q8_0"), "attn_k": ("Q8_0", "Q4_1"), "attn_v": ("BF16", "Q4_0"),
    "attn_output": ("Q4_1", "F16"), "ffn_gate": ("F16", "BF16"), "ffn_up": ("Q8_0", "Q4_1"),
    "ffn_down": ("Q4_0", "F32"),
}
SHAPES = {  # [out, in]
    "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
}


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-character alphabet: 256 single-character tokens."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    return [chars[b] for b in range(256)]


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, kind: str):
    """(data for GGUFWriter.add_tensor, its raw type or None, the values the file holds)."""
    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return w, None, w
    if kind == "F16":
        return w.astype(np.float16), None, w.astype(np.float16).astype(np.float32)
    data = gguf.quants.quantize(w, qt)
    return data, qt, gguf.quants.dequantize(data, qt)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, {engine parameter name: the float32 values the file encodes})."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    rng = np.random.default_rng(0)
    tokens = _byte_tokens() + ["\u0120t", "<s>", "</s>"]  # one merge: " t"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    values: dict[str, np.ndarray] = {}

    def put(gguf_name: str, engine_name: str, x: np.ndarray, kind: str, heads: int = 0):
        data, raw, held = _encode(_llama_cpp_order(x, heads) if heads else x, kind)
        w.add_tensor(gguf_name, data, raw_dtype=raw)
        # the engine's value: what the file holds, back in Hugging Face row order
        values[engine_name] = (held.reshape(heads, -1, 2, x.shape[1]).swapaxes(1, 2)
                               .reshape(x.shape) if heads else held)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    put("token_embd.weight", "model.embed_tokens.weight", normal(len(tokens), HIDDEN), "Q8_0")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(LAYERS):
        for kind, types in TYPES.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind, 0)
            put(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{names[kind]}.weight",
                normal(*SHAPES[kind]), types[i], heads)
        for kind, name in (("attn_norm", "input_layernorm"),
                           ("ffn_norm", "post_attention_layernorm")):
            put(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{name}.weight",
                1 + normal(HIDDEN), "F32")
    put("output_norm.weight", "model.norm.weight", 1 + normal(HIDDEN), "F32")
    put("output.weight", "lm_head.weight", normal(len(tokens), HIDDEN), "Q4_1")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, values


def test_weights_are_the_values_the_file_encodes(tiny_gguf):
    path, values = tiny_gguf
    llm = LLM(str(path), kv_cache_memory=8 << 20)
    params = dict(llm.engine.model.named_parameters())
    assert not llm.engine.model_config.tie_word_embeddings
    assert set(params) == set(values)
    for name, want in values.items():
        assert torch.equal(params[name], torch.from_numpy(want)), name


def test_logits_and_tokens_equal_transformers(tiny_gguf):
    transformers = pytest.importorskip("transformers")
    path, _ = tiny_gguf
    dense = ({"quantization_config": transformers.GgufConfig(dequantize=True)}
             if hasattr(transformers, "GgufConfig") else {})
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **dense).eval()
    llm = LLM(str(path), kv_cache_memory=8 << 20)
    ids = list(np.random.default_rng(1).integers(0, 256, 40))
    ids = [int(i) for i in ids]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_engine_logits(llm, ids), want, atol=1e-4, rtol=1e-4)
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out.output_token_ids == ref[0, len(ids):].tolist()


def test_bf16_engine_loads_within_bf16_rounding(tiny_gguf):
    path, values = tiny_gguf
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=8 << 20)
    q = llm.engine.model.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.bfloat16
    want = torch.from_numpy(values["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(q, want.to(torch.bfloat16))
