"""Model identity in the vLLM adapter (from a review of key derivation): every setting that
changes the KV a checkpoint gives (or where it comes from) changes the key, and the same
weights give the same key wherever they lie (no vLLM needed: stand-in configs and requests,
as test_engine_spec.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lmkv.config import ConfigError
from lmkv.model_id import model_fingerprint
from lmkv_engines.vllm.engines import engine_spec
from lmkv_engines.vllm.requests import RequestView


def _vllm_config(model: str, load_format: str = "auto", dcp: int = 1, tp: int = 1, **model_config):
    mc = SimpleNamespace(model=model, revision=None, dtype=torch.float32, get_num_layers=lambda pc: 2,
                         get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 64, use_mla=False,
                         is_hybrid=False, is_attention_free=False, quantization=None, hf_overrides={})
    vars(mc).update(model_config)
    return SimpleNamespace(
        model_config=mc,
        parallel_config=SimpleNamespace(world_size=tp, tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None))


@pytest.fixture(autouse=True)
def _no_lmkv_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "lmkv-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))  # no snapshot of anything


def test_mixed_mode_prompt_embeds_are_not_keyed_by_their_placeholder_tokens():
    """vLLM 0.32's chat prompts with prompt_embeds content parts carry prompt_token_ids whose
    embedding positions hold one placeholder id, whatever the embedding: two such requests
    with different embeddings have the same ids, so lmkv must not key them (vLLM's own block
    hashes add a hash of the embeddings)."""
    ids = [1, 2, 3] + [0] * 13  # 13 positions replaced by prompt_embeds in the forward pass
    mask = [True] * 3 + [False] * 13
    views = [RequestView(SimpleNamespace(
        request_id=f"r{i}", prompt_token_ids=ids, prompt_embeds=torch.full((16, 8), float(i)),
        prompt_is_token_ids=mask, all_token_ids=ids, lora_request=None, mm_features=[],
        cache_salt=None)) for i in range(2)]
    assert views[0].prompt_token_ids == [], "KV of different embeddings keyed by the same tokens"


def test_checkpoints_streamed_from_object_storage_are_keyed_by_their_weights(tmp_path):
    """vLLM (load_format runai_streamer, model s3://...) pulls only the *.json files into a
    local directory, sets mc.model to it and mc.model_weights to the URI: the directory holds
    no weights, so the id is config.json's alone, and a fine-tune (same config.json) shares
    every key with its base model."""
    ids = []
    for uri in ("s3://bucket/llama-base", "s3://bucket/llama-finetune"):
        local = tmp_path / uri.rsplit("/", 1)[1]
        local.mkdir()
        (local / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
        (local / "model.safetensors.index.json").write_text("{}")
        config = _vllm_config(str(local), load_format="runai_streamer", model_weights=uri)
        ids.append(engine_spec(config, {}).model_id)
    assert ids[0] != ids[1], f"base and fine-tune share the model id {ids[0]}"


def _mistral_dir(path, weights: bytes):
    """A checkpoint in Mistral's own format (vLLM 0.32 loads it by default: params.json and
    consolidated*.safetensors, no config.json)."""
    path.mkdir(parents=True)
    (path / "params.json").write_text(json.dumps({"dim": 128, "n_layers": 2, "head_dim": 64,
                                                  "n_heads": 2, "n_kv_heads": 1}))
    (path / "consolidated.safetensors").write_bytes(weights)
    return path


def test_a_mistral_format_checkpoint_is_keyed_by_its_content_not_its_path(tmp_path):
    """model_id takes a local directory's content only where it holds config.json; a
    Mistral-format directory is keyed by its path string (hub:/path@main): one checkpoint
    copied to two hosts at different paths never shares a chunk."""
    weights = bytes(range(256)) * 64
    a = _mistral_dir(tmp_path / "host-a" / "mistral", weights)
    b = _mistral_dir(tmp_path / "host-b" / "mistral", weights)
    id_a = engine_spec(_vllm_config(str(a)), {}).model_id
    id_b = engine_spec(_vllm_config(str(b)), {}).model_id
    assert id_a == id_b, f"one checkpoint at two paths: {id_a} vs {id_b} (never a hit between hosts)"


def test_a_mistral_format_checkpoint_with_new_weights_changes_the_key(tmp_path):
    """...and new weights put at the same path keep the old key: served the old weights' KV."""
    path = _mistral_dir(tmp_path / "mistral", bytes(1000))
    before = engine_spec(_vllm_config(str(path)), {}).model_id
    (path / "consolidated.safetensors").write_bytes(bytes(999) + b"\x01")  # a fine-tune, same path
    after = engine_spec(_vllm_config(str(path)), {}).model_id
    assert before != after, "new weights under the same path are served the old weights' chunks"


def test_a_single_file_checkpoint_is_keyed_by_its_content_not_its_path(tmp_path):
    """The same for a single-file checkpoint (a .gguf), which model_fingerprint reads by
    content (the bundled engine's id) but model_id never hands it (latent: vLLM 0.32 has no
    GGUF loader; earlier vLLMs serve --model x.gguf)."""
    data = b"GGUF" + bytes(range(256)) * 64
    a, b = tmp_path / "host-a" / "model.gguf", tmp_path / "host-b" / "model.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    id_a = engine_spec(_vllm_config(str(a)), {}).model_id
    id_b = engine_spec(_vllm_config(str(b)), {}).model_id
    assert id_a == id_b == model_fingerprint(a)


def test_dummy_weights_never_share_keys_with_the_checkpoint(tiny_model_dir):
    """--load-format dummy (vLLM's profiling/benchmark mode) runs random weights, but the id is
    the fingerprint of the directory's real weights: its chunks land under the real model's
    keys in a shared store."""
    real = engine_spec(_vllm_config(str(tiny_model_dir)), {}).model_id
    dummy = engine_spec(_vllm_config(str(tiny_model_dir), load_format="dummy"), {}).model_id
    assert real != dummy


def test_a_custom_online_quantization_config_changes_the_key(tiny_model_dir):
    """ModelConfig.quantization_config (per-layer specs, ignore patterns) changes the weights
    vLLM computes with; _variant names only ``quantization``."""
    plain = engine_spec(_vllm_config(str(tiny_model_dir), quantization="fp8"), {}).model_id
    custom = engine_spec(_vllm_config(str(tiny_model_dir), quantization="fp8",
                                      quantization_config={"ignore": ["re:.*self_attn.*"]}), {}).model_id
    assert plain != custom


def test_a_config_read_from_elsewhere_changes_the_key(tiny_model_dir, tmp_path):
    """--hf-config-path: vLLM builds the model (rope_theta, rope_scaling, ...) from another
    directory's config.json; the id hashes the model directory's."""
    other = tmp_path / "cfg"
    other.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    (other / "config.json").write_text(json.dumps(cfg))
    plain = engine_spec(_vllm_config(str(tiny_model_dir)), {}).model_id
    moved = engine_spec(_vllm_config(str(tiny_model_dir), hf_config_path=str(other)), {}).model_id
    assert plain != moved


def test_decode_context_parallelism_is_refused_or_joins_the_key(tiny_model_dir):
    """With decode_context_parallel_size > 1 each rank's KV holds only its share of the
    tokens (vLLM 0.32 shards GQA attention KV too, AttentionSpec.dcp_sharded), yet the layout
    (heads per rank, world size) is the same as without it."""
    plain = engine_spec(_vllm_config(str(tiny_model_dir), tp=2), {})
    try:
        dcp = engine_spec(_vllm_config(str(tiny_model_dir), tp=2, dcp=2), {})
    except ConfigError:
        return
    assert (plain.layout.fingerprint, plain.model_id) != (dcp.layout.fingerprint, dcp.model_id)
