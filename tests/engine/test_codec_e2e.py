"""The disk tier with the cachegen codec, end to end through the bundled engine: calibration
via the engine, tokens from compressed KV, and the quality gate's fallback to lossless.

The test model has random weights and is chaotic: 1% relative noise on its KV already flips
most greedy continuations (a trained model is far less sensitive; see docs/codec.md). So the
"same tokens" test calibrates to a 0.05% error, and the gate test uses the default setting,
where the gate must see the disagreement and turn the tier lossless."""

from __future__ import annotations

import pytest
import torch

from lmkv.codec.calibration import CacheGenTable, CalibrationSettings
from lmkv.config import load_config
from lmkv_engines.minimal.calibrate import calibrate_model
from lmkv_engines.minimal.llm import LLM

from ..redis_server import RedisServer
from .lmkv_workload import CHUNK, GREEDY, lmkv_llm, metric, prompts


def _full_chunks(p: list[int]) -> int:
    return (len(p) - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    return [llm.generate([p], GREEDY)[0].output_token_ids for p in prompts()]


def _table(model_dir, path, error: float):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.05)
    table, where = calibrate_model(str(model_dir), cfg, CalibrationSettings(error=error),
                                   num_prompts=4, length=256, out=path,
                                   kv_cache_memory=64 << 20)
    assert where == path and path.is_file()
    return table


def test_disk_tier_with_cachegen_gives_same_tokens(tiny_model_dir, reference, tmp_path):
    table = _table(tiny_model_dir, tmp_path / "fine.safetensors", error=5e-4)
    opts = dict(local_disk_codec="cachegen", cachegen_calibration=str(tmp_path / "fine.safetensors"))
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", **opts) as llm:
        assert [o.output_token_ids for o in llm.generate(prompts(), GREEDY)] == reference
        assert llm.engine.kv_connector.cache.storage.tiers[0].codec.name == "cachegen"
        assert llm.engine.kv_connector.cache.storage.tiers[0].table.table_id == table.table_id
    raw_bytes = sum(_full_chunks(p) // CHUNK for p in prompts()) * (2 * 2 * CHUNK * 64 * 4)
    stored = sum(f.stat().st_size for f in (tmp_path / "disk").rglob("*") if f.is_file())
    assert stored < raw_bytes / 2  # fp32 KV at a 0.05% error: still > 2x smaller
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", enable_prefetch=False, **opts) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference
        assert [o.num_external_tokens for o in outs] == [_full_chunks(p) for p in prompts()]
        assert metric(llm, "lmkv_tier_hits_total", tier="disk") == sum(
            _full_chunks(p) // CHUNK for p in prompts())
        assert metric(llm, "lmkv_errors_total", tier="disk", kind="corrupt") == 0


def test_remote_serde_cachegen_through_redis(tiny_model_dir, reference, tmp_path):
    import redis

    _table(tiny_model_dir, tmp_path / "fine.safetensors", error=5e-4)
    server = RedisServer(tmp_path / "redis").start()
    try:
        opts = dict(remote_url=server.url, remote_serde="cachegen", enable_prefetch=False,
                    cachegen_calibration=str(tmp_path / "fine.safetensors"))
        with lmkv_llm(tiny_model_dir, **opts) as llm:
            assert [o.output_token_ids for o in llm.generate(prompts(), GREEDY)] == reference
        client = redis.Redis(port=server.port)
        sizes = [client.strlen(k) for k in client.keys("*")]
        chunks = sum(_full_chunks(p) // CHUNK for p in prompts())
        assert len(sizes) == chunks and max(sizes) < (2 * 2 * CHUNK * 64 * 4) / 2
        with lmkv_llm(tiny_model_dir, **opts) as llm:  # a fresh hot cache: all from redis
            outs = llm.generate(prompts(), GREEDY)
            assert [o.output_token_ids for o in outs] == reference
            assert metric(llm, "lmkv_tier_hits_total", tier="remote") == chunks
    finally:
        server.kill()


def test_calibrate_cli_writes_where_the_engine_looks(tiny_model_dir, monkeypatch, tmp_path, capsys,
                                                    caplog):
    """engine calibrate names the table by lmkv's settings from LMKV_<KEY> variables (with
    or without LMKV_CONFIG_FILE), and does not warn that they are not used."""
    from lmkv_engines.minimal.cli import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default table path is under ~
    monkeypatch.setenv("LMKV_CHUNK_SIZE", str(CHUNK))
    monkeypatch.setenv("LMKV_MAX_LOCAL_CPU_SIZE", "0.05")
    assert main(["calibrate", "--model", str(tiny_model_dir), "--prompts", "2", "--length", "128",
                 "--error", "0.01", "--kv-cache-memory", "64MiB"]) == 0
    path = next((tmp_path / "home" / ".cache" / "lmkv" / "calibration").glob("*.safetensors"))
    assert "not used" not in caplog.text
    out = capsys.readouterr().out
    assert path.name in out and "decorrelating transform: " in out  # says which coding it chose
    assert "keys: measured before RoPE and coded un-rotated" in out
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", local_disk_codec="cachegen") as llm:
        tier = llm.engine.kv_connector.cache.storage.tiers[0]
        assert tier.codec.name == "cachegen" and tier.table.table_id == CacheGenTable.load(path).table_id
        assert tier.table.rope is not None  # the engine's rotary frequencies


def test_continuation_logits_read_the_given_kv_as_the_engine_would(tiny_model_dir):
    """The logits calibration weighs layers by: over the exact KV of a prefix they are the
    engine's own (its greedy token), they do not depend on where the prefix ends, they read
    the KV they are given, in any dtype."""
    p = prompts(1)[0]
    with LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20) as llm:
        eng = llm.engine
        kv = eng.compute_kv([p])[0]
        one, two = (eng.continuation_logits(p, kv[:, :, :n]) for n in (CHUNK, 2 * CHUNK))
        assert one.shape == (len(p) - CHUNK, eng.model_config.vocab_size) and one.dtype == torch.float32
        assert torch.allclose(one[CHUNK:], two, atol=1e-4)
        half = eng.continuation_logits(p, kv[:, :, :CHUNK].to(torch.bfloat16))  # taken in the model's
        assert half.shape == one.shape and torch.allclose(half, one, atol=0.5)
        first = llm.generate([p], GREEDY)[0].output_token_ids[0]
        assert int(two[-1].argmax()) == first
        other = kv[:, :, :CHUNK].clone()
        other[1, 1] = 0  # the last layer's values
        assert not torch.allclose(eng.continuation_logits(p, other), one, atol=1e-3)
        with pytest.raises(ValueError, match="must leave some"):
            eng.continuation_logits(p, kv)


def test_calibration_weighs_layers_by_their_effect(tiny_model_dir, tmp_path, capsys):
    """engine calibrate (by default) gives each layer the target its measured effect on the
    output calls for; --ramp keeps the ramp."""
    from lmkv_engines.minimal.cli import main

    common = ["calibrate", "--model", str(tiny_model_dir), "--prompts", "2", "--length", "128",
              "--error", "0.05", "--kv-cache-memory", "64MiB"]
    env = {"LMKV_CHUNK_SIZE": str(CHUNK), "LMKV_MAX_LOCAL_CPU_SIZE": "0.05"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert main(common + ["--out", str(tmp_path / "w.safetensors")]) == 0
        assert "weighed by each layer's measured effect" in capsys.readouterr().out
        assert main(common + ["--out", str(tmp_path / "r.safetensors"), "--ramp"]) == 0
        assert "(on the ramp)" in capsys.readouterr().out
    weighed = CacheGenTable.load(tmp_path / "w.safetensors").target
    ramp = CacheGenTable.load(tmp_path / "r.safetensors").target
    assert torch.allclose(ramp, CalibrationSettings(error=0.05).targets(2))
    assert not torch.allclose(weighed, ramp) and bool((weighed > 0).all())


def test_missing_calibration_falls_back_to_zstd(tiny_model_dir, reference, tmp_path):
    opts = dict(local_disk_codec="cachegen", cachegen_calibration=str(tmp_path / "none.safetensors"))
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", **opts) as llm:
        assert llm.engine.kv_connector.cache.storage.tiers[0].codec.name == "zstd"
        assert [o.output_token_ids for o in llm.generate(prompts(), GREEDY)] == reference


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_quality_gate_measures_agreement_and_turns_lossless(tiny_model_dir, reference, tmp_path,
                                                            prefix_caching):
    """With the engine's prefix cache on, the pages it holds of KV loaded lossy (and those
    computed over them) are forgotten when the gate trips: they were served again after it,
    to 5 of 6 prompts."""
    _table(tiny_model_dir, tmp_path / "default.safetensors", error=CalibrationSettings().error)
    opts = dict(local_disk_codec="cachegen", cachegen_calibration=str(tmp_path / "default.safetensors"),
                codec_check_every=2, codec_min_agreement=0.99, enable_prefetch=False)
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", **opts) as llm:
        llm.generate(prompts(), GREEDY)  # fills the disk tier (and the hot cache, exact KV)
        assert metric(llm, "lmkv_codec_checks_total") == 0  # nothing was served lossy
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", prefix_caching=prefix_caching, **opts) as llm:
        engine = llm.engine.kv_connector.cache
        served = llm.generate(prompts(), GREEDY)  # every prompt is served lossy KV from disk
        agreement = metric(llm, "lmkv_codec_agreement")
        same = sum(o.output_token_ids == r for o, r in zip(served, reference, strict=True))
        print(f"default setting on the random test model: agreement {agreement:.2%}, "
              f"{same}/{len(reference)} prompts identical")
        assert metric(llm, "lmkv_codec_checks_total") == 3  # 1 in 2 of 6 requests
        assert metric(llm, "lmkv_codec_checked_tokens_total") == 3 * GREEDY.max_tokens
        # the re-runs are the engine's own: not in the request and token counts users see
        m = llm.engine.metrics
        assert m.requests_finished.labels("length")._value.get() == len(reference)
        assert m.generation_tokens._value.get() == len(reference) * GREEDY.max_tokens
        assert agreement < 0.99 and metric(llm, "lmkv_codec_fallbacks_total") == 1
        assert engine.storage.tiers[0].codec.name == "zstd" and engine.gate.tripped
        # after the fallback nothing lossy is served: exact tokens again, the lossy chunks
        # on disk are dropped and recomputed, and rewritten lossless
        assert [o.output_token_ids for o in llm.generate(prompts(), GREEDY)] == reference
        assert [o.output_token_ids for o in llm.generate(prompts(), GREEDY)] == reference
        engine.pool.check_integrity()


STORY = ("In the village of Marrowby the old clock on the chapel tower had stopped at a quarter "
         "past nine. Nobody could say when it had stopped, because the villagers had long ago "
         "stopped looking up. It was Edda Fenwick, the baker's daughter, who climbed the tower "
         "one wet April morning with a bag of her father's tools and set it going again. ")


def test_smollm2_disk_tier_decodes_natively_and_serves_the_same_tokens(tmp_path, monkeypatch):
    """The real model's table has the transform and un-rotated keys, so its chunks decode
    through the native decoder (where it can be built): a new engine served from the disk
    tier alone, at a fine error target, gives full prefill's tokens. (At 5e-4 its layer-0 keys
    reach 23K steps from the mean: before OutOfRange they were clamped, 10% off, and the
    tokens differed; now those chunks are stored lossless.) The table is the ramp's: weighing
    layers (tested on the tiny model) would add ~25 s of forward passes here."""
    from lmkv.codec import native
    from lmkv_engines.minimal.default_model import default_model_path

    try:
        path = str(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    chunk, engine_args = 64, dict(kv_cache_memory=96 << 20, max_model_len=1024)
    cfg = load_config(env={}, chunk_size=chunk, max_local_cpu_size=0.05)
    table, where = calibrate_model(path, cfg, CalibrationSettings(error=2e-3, weigh_layers=False),
                                   num_prompts=1, length=256, out=tmp_path / "t.safetensors",
                                   **engine_args)
    engine_args["enable_prefix_caching"] = False
    assert table.basis is not None and table.rope is not None
    with LLM(path, **engine_args) as llm:
        few = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{STORY * (1 + i)}\nWho repaired the clock, and when?"}]))
            for i in range(3)]  # a trained model's answers to text are decisive; to random ids, not
        reference = [o.output_token_ids for o in llm.generate(few, GREEDY)]
    opts = dict(chunk_size=chunk, max_local_cpu_size=0.05, local_disk=str(tmp_path / "disk"),
                max_local_disk_size=1.0, local_disk_codec="cachegen", cachegen_calibration=str(where))
    with LLM(path, lmkv_config=load_config(env={}, **opts), **engine_args) as llm:
        assert [o.output_token_ids for o in llm.generate(few, GREEDY)] == reference
    lib, calls = native.library(), []
    if lib is not None:
        name = "lmkv_decode_amx" if lib.lmkv_amx() else "lmkv_symbols"
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a: calls.append(1) or real(*a))
    with LLM(path, lmkv_config=load_config(env={}, enable_prefetch=False, **opts), **engine_args) as llm:
        outs = llm.generate(few, GREEDY)
        assert [o.output_token_ids for o in outs] == reference
        assert [o.num_external_tokens for o in outs] == [(len(p) - 1) // chunk * chunk for p in few]
        assert metric(llm, "lmkv_errors_total", tier="disk", kind="corrupt") == 0
        read = metric(llm, "lmkv_tier_hits_total", tier="disk")  # chunks the prompts share: once
    assert read >= 3 and (lib is None or len(calls) == read)


def test_chunks_computed_over_lossy_kv_are_kept_as_lossy(tiny_model_dir, tmp_path):
    """A prompt served lossy KV from a cachegen disk tier and extended by a new chunk: the
    new chunk, computed over that KV, enters the hot cache marked lossy (the quality gate
    samples requests that load it, its fallback drops it; which tiers take it: test_codec)."""
    _table(tiny_model_dir, tmp_path / "fine.safetensors", error=5e-4)
    opts = dict(local_disk_codec="cachegen", cachegen_calibration=str(tmp_path / "fine.safetensors"),
                codec_check_every=0, enable_prefetch=False)
    first = prompts(n=1)[0][: 4 * CHUNK + 1]
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", **opts) as llm:
        llm.generate([first], GREEDY)
    extended = first[:-1] + prompts(n=1, seed=9)[0][: 2 * CHUNK + 1]
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", **opts) as llm:  # a fresh hot cache
        cache = llm.engine.kv_connector.cache
        out = llm.generate([extended], GREEDY)[0]
        assert out.num_external_tokens == 4 * CHUNK  # decoded lossy from disk
        cache.storage.io.drain()
        keys = cache.keys(extended[: 6 * CHUNK])
        hot = cache.storage.hot.entries
        assert [hot[k].lossy for k in keys[4:]] == [True, True]
        assert all(hot[k].lossy for k in keys[:4])


def test_a_trip_keeps_later_pages_of_requests_served_lossy_out_of_the_prefix_cache(tiny_model_dir):
    """The gate trips while a request served lossy KV still runs: its pages computed after
    the trip (over that KV) are never registered in the engine's prefix cache (they were,
    and a later request with the same tokens was served them as exact); a request served
    exact registers its own as before."""
    from lmkv_engines.minimal.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with lmkv_llm(tiny_model_dir, prefix_caching=True) as llm:
        eng = llm.engine
        eng.kv_connector.scheduler.served_lossy = lambda req: req.request_id == "lossy"
        first, second = prompts(n=2, length=100, seed=3)
        eng.add_request("lossy", first, params)
        eng.add_request("exact", second, params)
        eng.step()
        eng.kv_connector.forget_cached_pages()  # what a trip calls
        assert not eng.block_manager.cached
        blocks = {name: set() for name in ("lossy", "exact")}
        while eng.has_unfinished_requests():
            for name in blocks:
                if name in eng.requests:
                    blocks[name].update(eng.requests[name].block_ids)
            eng.step()
        registered = {b.block_id for copies in eng.block_manager.cached.values()
                      for b in copies.values()}
        assert registered and registered <= blocks["exact"]
