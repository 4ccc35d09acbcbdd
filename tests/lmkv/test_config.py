from __future__ import annotations

import pytest
import torch

from lmkv.config import ConfigError, LMKVConfig, load_config


def test_precedence_defaults_yaml_env_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 128\nmax_local_cpu_size: 2\nsave_decode_cache: true\n")
    cfg = load_config(path, env={"LMKV_MAX_LOCAL_CPU_SIZE": "3.5", "LMKV_USE_LAYERWISE": "true"},
                      save_decode_cache=False)
    assert cfg.chunk_size == 128  # yaml over default
    assert cfg.max_local_cpu_size == 3.5  # env over yaml
    assert cfg.use_layerwise is True
    assert cfg.save_decode_cache is False  # override over yaml
    assert cfg.enable_prefetch is True  # default


def test_config_file_from_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\n")
    assert load_config(env={"LMKV_CONFIG_FILE": str(path)}).chunk_size == 64


def test_lmkvs_switches_in_the_environment_are_not_config_keys(tmp_path):
    """LMKV_NATIVE_* turn native code off, LMKV_CODEC_PRODUCT sets cachegen's product dtype;
    a config read beside them must not fail on them."""
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\n")
    env = {"LMKV_CONFIG_FILE": str(path), "LMKV_CACHE_DIR": "/tmp/x", "LMKV_NATIVE_DECODE": "0",
           "LMKV_NATIVE_COPY": "0", "LMKV_NATIVE_ATTENTION": "0", "LMKV_CODEC_PRODUCT": "float32",
           "LMKV_CUDA_KERNELS": "0"}
    assert load_config(env=env).chunk_size == 64


def test_lmcache_yaml_is_accepted(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 5\n"
        f"local_disk: file://{tmp_path}/disk/\nmax_local_disk_size: 10\n"
        "save_decode_cache: false\nuse_layerwise: false\nremote_serde: naive\n"
    )
    cfg = load_config(path, env={})
    assert cfg.local_disk == f"{tmp_path}/disk/" and cfg.disk_bytes == 10 * 10**9


@pytest.mark.parametrize("yaml_text,key", [
    ("chunk_sise: 256\n", "chunk_sise"),
    ("chunk_size: 0\n", "chunk_size"),
    ("chunk_size: big\n", "chunk_size"),
    ("chunk_size: true\n", "chunk_size"),
    ("max_local_cpu_size: -1\n", "max_local_cpu_size"),
    ("local_disk: /tmp/x\n", "max_local_disk_size"),
    ("remote_serde: pickle\n", "remote_serde"),
    ("use_layerwise: maybe\n", "use_layerwise"),
    ("save_unfull_chunk: maybe\n", "save_unfull_chunk"),
    ("blend_recompute_ratio: 2\n", "blend_recompute_ratio"),
    ("blend_store_pre_rope: sometimes\n", "blend_store_pre_rope"),
    ("metrics_port: 70000\n", "metrics_port"),
    ("local_cpu: false\n", "local_cpu"),  # with no tier below, nothing would be stored
    ("codec_check_every: -1\n", "codec_check_every"),
    ("remote_timeout: .inf\n", "remote_timeout"),  # no deadline at all
    ("remote_timeout: .nan\n", "remote_timeout"),
    ("remote_timeout: 0.0000001\n", "remote_timeout"),  # a 0 timeval: no timeout
    ("max_local_cpu_size: .inf\n", "max_local_cpu_size"),  # (failed later, naming no key)
    ("local_disk: /d\nmax_local_disk_size: .inf\n", "max_local_disk_size"),
    ("local_disk: file:///a/,file:///b/\nmax_local_disk_size: 1\n", "local_disk"),  # LMCache's list
    ("metrics_host: ''\n", "metrics_host"),
    ("metrics_host: localhost:9100\n", "metrics_host"),
    ("blend_recompute_ratios: [0.15, 0.3]\n", "blend_recompute_ratios"),  # lmkv has one ratio
    ("blend_check_layers: [1, 4]\n", "blend_check_layers"),
    ("blend_check_layers: 1\n", "blend_check_layers"),  # LMCache's is a list
    ("blend_check_layers: [1]\nblend_check_layer: 2\n", "blend_check_layers"),
    ("blend_recompute_ratios: [2]\n", "blend_recompute_ratio"),
    ("enable_blending: true\nblend_check_layer: 0\n", "blend_check_layer must be >= 1"),
    ("blend_thresholds: [0.5]\n", "blend_thresholds"),
])
def test_bad_keys_and_values_name_the_key(tmp_path, yaml_text, key):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=key):
        load_config(path, env={})


def test_bad_env_and_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config(env={"LMKV_CHUNK_SIZE": "lots"})
    with pytest.raises(ConfigError, match="no_such_key"):
        load_config(env={"LMKV_NO_SUCH_KEY": "1"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml", env={})
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(tmp_path / "bad.yaml", env={})


def test_lmcaches_blend_keys_are_read(tmp_path):
    """LMCache's CacheBlend YAML: its lists of one ratio and one check layer, and the keys it
    reads but does not use."""
    path = tmp_path / "blend.yaml"
    path.write_text("enable_blending: true\nblend_recompute_ratios: [0.3]\nblend_check_layers: [2]\n"
                    "blend_thresholds: null\nblend_min_tokens: 256\nblend_special_str: ' # # '\n")
    cfg = load_config(path, env={})
    assert (cfg.blend_recompute_ratio, cfg.blend_check_layer) == (0.3, 2)
    # the environment and overrides win over the file, whichever spelling each uses
    env = {"LMKV_BLEND_RECOMPUTE_RATIO": "0.5"}
    assert load_config(path, env=env).blend_recompute_ratio == 0.5
    assert load_config(path, env=env, blend_recompute_ratios=[0.7]).blend_recompute_ratio == 0.7
    assert load_config(path, env={}, blend_check_layer=3).blend_check_layer == 3


def test_lmcache_spellings_and_the_projects_own_variables():
    assert load_config(env={}, cache_policy="LRU").cache_policy == "lru"  # LMCache's default
    assert load_config(env={}, metrics_host="::1").metrics_host == "::1"
    cfg = load_config(env={"LMKV_LMCACHE_VENV": "/v", "LMKV_EXTRAS": "test", "LMKV_CHUNK_SIZE": "64"})
    assert cfg.chunk_size == 64


def test_config_is_frozen():
    cfg = LMKVConfig()
    with pytest.raises(AttributeError):
        cfg.chunk_size = 1  # type: ignore[misc]


def test_local_cpu_false_is_accepted_with_a_tier_below(tmp_path):
    cfg = load_config(env={}, local_cpu=False, remote_url="lm://127.0.0.1:9000")
    assert not cfg.local_cpu
    cfg = load_config(env={}, local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=1)
    assert not cfg.local_cpu


def test_a_lossy_codec_ships_with_the_quality_gate_on(tmp_path):
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": 1.0}
    assert load_config(env={}, **disk).quality_check_every == 0  # lossless: nothing to check
    # (a rate given without a lossy codec checks nothing either: vLLM refused such a config)
    assert load_config(env={}, codec_check_every=16, **disk).quality_check_every == 0
    lossy = load_config(env={}, local_disk_codec="cachegen", **disk)
    assert lossy.codec_check_every is None and lossy.quality_check_every == 16
    remote = load_config(env={}, remote_url="redis://127.0.0.1:1", remote_serde="cachegen")
    assert remote.quality_check_every == 16
    off = load_config(env={"LMKV_CODEC_CHECK_EVERY": "0"}, local_disk_codec="cachegen", **disk)
    assert off.quality_check_every == 0  # turned off explicitly


@pytest.mark.parametrize("url, why", [
    ("lm://127.0.0.1", "needs host and port"),
    ("lm://127.0.0.1:9000/x", "no path"),
    ("redis://127.0.0.1:notaport", "bad port"),
    ("redis://127.0.0.1:99999", "bad port"),
    ("mooncakestore://127.0.0.1:50051?local_buffer_size=abc", "local_buffer_size"),
    ("mooncakestore://127.0.0.1:50051?global_segment_size=-1gb", "global_segment_size"),
    ("http://127.0.0.1:1", "unsupported scheme"),
])
def test_a_remote_url_that_can_never_work_is_refused_at_start(url, why):
    """Refused when the config is read, naming the key and what is wrong (before, these
    passed and the tier failed every call, seen only as throttled warnings)."""
    with pytest.raises(ConfigError, match=f"remote_url: .*{why}"):
        load_config(env={}, remote_url=url)
    assert load_config(env={}, remote_url="lm://127.0.0.1:9000").remote_url
    assert load_config(env={}, remote_url="mooncakestore://h:1/?local_buffer_size=1gb").remote_url


def test_lmkv_variables_without_a_config_file_are_named_not_ignored_silently(caplog):
    from lmkv.config import off_but_configured
    from lmkv_engines.minimal.cli import _lmkv_config

    env = {"LMKV_LOCAL_DISK": "/data", "LMKV_MAX_LOCAL_DISK_SIZE": "50", "LMKV_CACHE_DIR": "/c"}
    warning = off_but_configured(env)
    assert "LMKV_LOCAL_DISK, LMKV_MAX_LOCAL_DISK_SIZE are not used" in warning
    assert off_but_configured({**env, "LMKV_CONFIG_FILE": "x.yaml"}) is None
    assert off_but_configured({"LMKV_CACHE_DIR": "/c"}) is None  # not a key
    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING"):
        mp.delenv("LMKV_CONFIG_FILE", raising=False)
        mp.setenv("LMKV_CHUNK_SIZE", "64")
        assert _lmkv_config() is None
    assert "LMKV_CHUNK_SIZE is not used" in caplog.text


@pytest.mark.parametrize("key", ["on", "1", "yes"])
def test_a_yaml_key_read_as_a_boolean_or_number_is_named_not_a_traceback(tmp_path, key):
    """PyYAML reads `on:` or `1:` as True or 1: sorting the unknown keys raised TypeError."""
    path = tmp_path / "lmkv.yaml"
    path.write_text(f"chunk_size: 256\nchunk_sise: 3\n{key}: 3\n")  # (with a typo: both unknown)
    with pytest.raises(ConfigError, match="keys must be names"):
        load_config(path, env={})


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path):
    """Plain YAML keeps the last of two equal keys: a key copied and changed in one place
    only was taken silently (found by a new-user walkthrough)."""
    path = tmp_path / "lmkv.yaml"
    path.write_text("max_local_cpu_size: 2\nchunk_size: 256\nmax_local_cpu_size: 3\n")
    with pytest.raises(ConfigError, match=r"(?s)found the key 'max_local_cpu_size' twice.*line 3"):
        load_config(path, env={})
    path.write_text("max_local_cpu_size: 2\nchunk_size: 256\n? [a, b]\n: 1\n")  # (a list key)
    with pytest.raises(ConfigError, match="found unhashable key"):  # (YAML's own error)
        load_config(path, env={})


def test_a_disk_directory_under_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(env={}, local_disk="~/lmkv-disk", max_local_disk_size=1)
    assert cfg.local_disk == f"{tmp_path}/lmkv-disk"


def test_a_mooncake_url_setting_with_a_typo_is_refused_like_a_redis_one(monkeypatch):
    """docs/configuration.md: the Mooncake URL's settings are "checked at start", and a Redis
    URL's unknown setting is refused (check_redis_url). A typo in a Mooncake setting is
    taken silently: metadata_server falls back to http://<master>:8080/metadata."""
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ConfigError, match="remote_url: .*metadata_sever"):
        load_config(env={}, remote_url="mooncakestore://127.0.0.1:50051/"
                                       "?metadata_sever=http://meta:8080/metadata")


def test_a_redis_database_that_is_not_a_number_is_refused():
    """`redis://host:port[/db]`: redis-py reads a path it cannot parse as database 0, so
    /db1 (or /l for /1) silently shares database 0 with whatever else uses it."""
    with pytest.raises(ConfigError, match="remote_url"):
        load_config(env={}, remote_url="redis://127.0.0.1:6379/db1")


def test_a_calibration_file_under_home_is_expanded_as_local_disk_is(tmp_path, monkeypatch):
    """local_disk: ~/x is expanded; cachegen_calibration: ~/x is not, so the table is
    "not found" and the cachegen tiers silently store zstd (one warning at start)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(env={}, cachegen_calibration="~/tables/smol.safetensors")
    assert cfg.cachegen_calibration == f"{tmp_path}/tables/smol.safetensors"


def test_a_disk_cap_below_one_chunk_is_refused_at_start(tmp_path):
    """The hot cache refuses a size that cannot hold one chunk (MemoryPool, at start);
    the disk tier starts with such a cap and then fails every write ("a 1088-byte entry
    exceeds the disk tier cap"), logged as a disk failure every 1..30 s for ever."""
    from lmkv.cache import LMKVCache
    from lmkv.layout import KVLayout

    cfg = load_config(env={}, chunk_size=16, max_local_cpu_size=0.001,
                      local_disk=str(tmp_path), max_local_disk_size=1e-6)  # 1000 bytes
    layout = KVLayout(2, 1, 4, torch.float32, 16)  # a 1088-byte frame per chunk
    with pytest.raises(ValueError, match="max_local_disk_size"):
        LMKVCache(cfg, layout, "model").close()


def test_the_start_up_line_claims_o_direct_reads_only_where_they_happen(tmp_path):
    """Only raw frames are read with O_DIRECT (Tier.read: get_into_many); a zstd or
    cachegen disk tier reads whole files through the page cache, yet describe() (the
    "lmkv ready:" line) says "O_DIRECT reads" for it."""
    cfg = load_config(env={}, local_disk=str(tmp_path), max_local_disk_size=1,
                      local_disk_codec="zstd")
    assert "O_DIRECT" not in cfg.describe()


def test_an_lmcache_environment_is_read(tmp_path, caplog):
    """A deployment moved from LMCache's connector keeps LMCACHE_* in its environment: lmkv
    read none of it and ran on its defaults, without a word. Its config file and the
    variables naming lmkv's keys are read (lmkv's own take precedence); others are named."""
    import logging

    lmcache_yaml = tmp_path / "lmcache.yaml"
    lmcache_yaml.write_text("chunk_size: 512\nlocal_disk: file:///tmp/lmkv-x/\nmax_local_disk_size: 5\n")
    env = {"LMCACHE_CONFIG_FILE": str(lmcache_yaml), "LMCACHE_REMOTE_URL": "lm://127.0.0.1:65432",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "3", "LMKV_MAX_LOCAL_CPU_SIZE": "2",
           "LMCACHE_BLEND_RECOMPUTE_RATIOS": "[0.2]", "LMCACHE_USE_EXPERIMENTAL": "true"}
    with caplog.at_level(logging.INFO, logger="lmkv.config"):
        cfg = load_config(env=env)
    assert (cfg.chunk_size, cfg.local_disk, cfg.max_local_disk_size) == (512, "/tmp/lmkv-x/", 5)
    assert cfg.remote_url == "lm://127.0.0.1:65432" and cfg.max_local_cpu_size == 2
    assert cfg.blend_recompute_ratio == 0.2
    said = caplog.text
    assert "LMCACHE_USE_EXPERIMENTAL names no lmkv setting" in said
    assert "reading LMCache's config file" in said
    assert load_config(env={"LMKV_BLEND_CHECK_LAYERS": "[3]"}).blend_check_layer == 3
    with pytest.raises(ConfigError, match="LMCACHE_CHUNK_SIZE"):
        load_config(env={"LMCACHE_CHUNK_SIZE": "many"})
    with pytest.raises(ConfigError, match="cache_policy .* read too: LMCACHE_CACHE_POLICY"):
        load_config(env={"LMCACHE_CACHE_POLICY": "LFU"})  # (LMCache's, not lmkv's)
    with pytest.raises(ConfigError, match="LMCACHE_BLEND_RECOMPUTE_RATIOS.* must be one value"):
        load_config(env={"LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15,0.2"})
