"""How the vLLM connector turns vLLM's config into lmkv's (no vLLM needed: a stand-in
config with the attributes the connector reads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmkv.config import ConfigError
from lmkv.model_id import model_fingerprint
from lmkv_engines.vllm.engines import engine_spec


def _vllm_config(model: str, block_size: int = 128, world_size: int = 1, cache_dtype: str = "auto",
                 kv_role: str = "kv_both", tp: int = 1, pp: int = 1, **model_config):
    mc = SimpleNamespace(model=model, revision=None, dtype=torch.float32, get_num_layers=lambda pc: 2,
                         get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 64, use_mla=False,
                         is_hybrid=False, is_attention_free=False)
    vars(mc).update(model_config)
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(
                               world_size=world_size, tensor_parallel_size=tp, pipeline_parallel_size=pp),
                           cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype),
                           kv_transfer_config=SimpleNamespace(kv_role=kv_role))


def test_extra_config_overrides_yaml_and_env(tmp_path, monkeypatch, tiny_model_dir):
    yaml = tmp_path / "lmkv.yaml"
    yaml.write_text("chunk_size: 512\nmax_local_cpu_size: 0.5\n")
    monkeypatch.setenv("LMKV_CONFIG_FILE", str(yaml))
    monkeypatch.setenv("LMKV_CACHE_SALT", "tenant-a")
    spec = engine_spec(_vllm_config(str(tiny_model_dir)), {"chunk_size": 256})
    assert spec.config.chunk_size == 256 and spec.config.max_local_cpu_size == 0.5
    assert spec.config.cache_salt == "tenant-a"
    assert spec.layout.chunk_shape == (2, 2, 256, 1, 64) and spec.block_size == 128
    assert spec.model_id == model_fingerprint(tiny_model_dir)  # what the bundled engine uses


def test_vllm_producer_and_consumer_roles_carry_over(monkeypatch):
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    assert engine_spec(_vllm_config("m"), {}).config.kv_role == "both"
    assert engine_spec(_vllm_config("m", kv_role="kv_producer"), {}).config.kv_role == "producer"
    assert engine_spec(_vllm_config("m", kv_role="kv_consumer"), {}).config.kv_role == "consumer"
    assert engine_spec(_vllm_config("m", kv_role="kv_consumer"), {"kv_role": "both"}).config.kv_role == "both"


def test_hub_names_without_a_local_snapshot_are_keyed_by_name_and_revision(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # (an empty hub cache)
    spec = engine_spec(_vllm_config("org/model"), {})
    assert spec.model_id == "hub:org/model@main"
    assert "not by its weights" in caplog.text
    caplog.clear()
    spec = engine_spec(_vllm_config("org/model", revision="0123456789abcdef0123456789abcdef01234567"), {})
    assert spec.model_id == "hub:org/model@0123456789abcdef0123456789abcdef01234567"
    assert "not by its weights" not in caplog.text  # a commit names one set of weights


def test_hub_names_are_keyed_by_the_weights_of_their_local_snapshot(monkeypatch, tmp_path, tiny_model_dir):
    """vLLM downloads a hub model into the hub cache before the connector starts: the chunks
    are keyed by that snapshot's weights, so new weights pushed under the same branch name
    (or another host's older snapshot) never share chunks with the old ones."""
    import shutil

    repo = tmp_path / "hub" / "models--org--model"
    for sha, byte in (("a" * 40, 1), ("b" * 40, 2)):
        snap = repo / "snapshots" / sha
        shutil.copytree(tiny_model_dir, snap)
        weights = next(snap.glob("*.safetensors"))
        data = bytearray(weights.read_bytes())
        data[-1] ^= byte  # one weight differs
        weights.write_bytes(bytes(data))
    (repo / "refs").mkdir()
    ids = []
    for sha in ("a" * 40, "b" * 40):
        (repo / "refs" / "main").write_text(sha)
        config = _vllm_config("org/model")
        config.load_config = SimpleNamespace(download_dir=str(tmp_path / "hub"))
        ids.append(engine_spec(config, {}).model_id)
        assert ids[-1] == model_fingerprint(repo / "snapshots" / sha)
    assert ids[0] != ids[1]


@pytest.mark.parametrize("method, refused", [("eagle", True), ("draft_model", True), ("ngram", False)])
def test_speculative_decoding_with_a_draft_models_kv_is_refused_by_name(monkeypatch, method, refused):
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    draft_kv = method in ("eagle", "draft_model")
    config = _vllm_config("m")
    config.speculative_config = SimpleNamespace(method=method, uses_draft_kv_cache=lambda: draft_kv)
    if refused:
        with pytest.raises(ConfigError, match=f"KV of its own \\(method '{method}'\\)"):
            engine_spec(config, {})
    else:
        engine_spec(config, {})


def test_a_load_failure_policy_that_fails_requests_is_warned_about(monkeypatch, caplog):
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    config = _vllm_config("m")
    config.kv_transfer_config.kv_load_failure_policy = "fail"
    engine_spec(config, {})
    assert "kv_load_failure_policy is 'fail'" in caplog.text
    caplog.clear()
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    engine_spec(config, {})
    assert "kv_load_failure_policy" not in caplog.text


@pytest.mark.parametrize("extra, vllm, message", [
    ({"chunk_sise": 256}, {}, "chunk_sise"),
    ({"chunk_size": 192}, {}, "chunk_size 192 must be a multiple of vLLM's block size 128"),
    ({}, {"world_size": 2, "pp": 2}, "pipeline_parallel_size 1"),
    ({}, {"cache_dtype": "fp8"}, "kv_cache_dtype fp8"),
    ({"enable_blending": True}, {}, "enable_blending"),
    ({}, {"use_mla": True}, "multi-head latent attention"),
    ({}, {"is_hybrid": True}, "state-space"),
    ({}, {"is_attention_free": True}, "state-space"),
    ({"remote_url": "nope://x"}, {}, "remote_url"),
    ({"local_disk": "/tmp/x", "max_local_disk_size": 1, "local_disk_codec": "cachegen"}, {},
     "codec_check_every: 0"),
])
def test_bad_settings_fail_naming_the_key(monkeypatch, extra, vllm, message):
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    with pytest.raises(ConfigError, match=message):
        engine_spec(_vllm_config("org/model", **vllm), extra)


def test_a_lossy_codec_runs_ungated_only_when_asked(monkeypatch):
    """The quality gate re-runs requests in the bundled engine only: inside vLLM a lossy
    codec needs codec_check_every: 0 said explicitly."""
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    extra = {"local_disk": "/tmp/x", "max_local_disk_size": 1, "local_disk_codec": "cachegen",
             "codec_check_every": 0}
    assert engine_spec(_vllm_config("org/model"), extra).config.uses_cachegen


def test_tensor_parallel_ranks_are_accepted_each_with_its_shard(monkeypatch):
    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)
    spec = engine_spec(_vllm_config("org/model", world_size=2, tp=2), {})
    assert spec.tp_size == 2 and spec.layout.num_kv_heads == 1  # the heads of one rank


def test_each_rank_serves_its_metrics_on_a_port_of_its_own():
    from lmkv.config import load_config
    from lmkv_engines.vllm.engines import rank_config

    cfg = load_config(env={}, metrics_port=9100)
    assert [rank_config(cfg, r, 2).metrics_port for r in (0, 1)] == [9100, 9101]
    assert rank_config(cfg, 1, 2, dp_rank=1).metrics_port == 9103
    assert rank_config(load_config(env={}), 1, 2).metrics_port == 0  # off stays off
    with pytest.raises(ConfigError, match="past 65535"):
        rank_config(load_config(env={}, metrics_port=65535), 1, 2)


@pytest.mark.parametrize("key", ["path", "env"])
def test_extra_config_cannot_reach_load_configs_own_parameters(key):
    with pytest.raises(ConfigError, match=f"unknown lmkv config key.*{key}"):
        engine_spec(_vllm_config("/m"), {key: "/etc/passwd"})


def test_vllm_settings_that_change_the_kv_of_the_same_weights_change_the_model_id(tiny_model_dir):
    base = _vllm_config(str(tiny_model_dir))
    plain = engine_spec(base, {}).model_id
    ids = {plain}
    for attrs in ({"quantization": "fp8"}, {"hf_overrides": {"rope_theta": 5e5}},
                  {"hf_overrides": {"rope_theta": 1e6}}, {"quantization": None, "hf_overrides": {}}):
        cfg = _vllm_config(str(tiny_model_dir))
        for name, value in attrs.items():
            setattr(cfg.model_config, name, value)
        ids.add(engine_spec(cfg, {}).model_id)
    assert len(ids) == 4  # the last one (nothing set) is the plain id
    assert plain == model_fingerprint(tiny_model_dir)


def test_ranks_of_different_tensor_parallel_sizes_never_share_keys(monkeypatch):
    """With fewer KV heads than ranks vLLM replicates heads: rank 1 of TP=2 holds head 1 of
    2, rank 1 of TP=4 head 0, in chunks of one shape. The split is part of the key (it was
    not: such engines sharing a store loaded each other's heads)."""
    from dataclasses import replace

    from lmkv.keys import KeyScope

    monkeypatch.delenv("LMKV_CONFIG_FILE", raising=False)

    def key(tp: int, rank: int) -> str:
        cfg = _vllm_config("org/model", block_size=16, world_size=tp, tp=tp)
        cfg.model_config.get_num_kv_heads = lambda pc: max(1, 2 // pc.tensor_parallel_size)
        spec = engine_spec(cfg, {"chunk_size": 16})
        layout = replace(spec.layout, rank=rank)  # as the connector's worker role makes it
        return KeyScope(spec.model_id, layout).key(bytes(range(16)))

    assert key(2, 1) != key(4, 1)
    # one rank: the bundled engine's layout (world_size 1), so the two share entries
    assert engine_spec(_vllm_config("org/model", block_size=16), {"chunk_size": 16}).layout.world_size == 1
