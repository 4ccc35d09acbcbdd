"""CacheBlend through the bundled engine: precompute RAG chunks, then prompts that use them
in any order. Ratio 1 reproduces a full prefill; ratio 0 is naive concatenation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lmkv.blend.segments import join_segments, split_segments
from lmkv.config import load_config
from lmkv.ops import rerotate_keys
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _docs(seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (70, 40, 100)]
    return docs, torch.randint(5, 4000, (12,), generator=g).tolist()


def _blend_llm(model_dir, ratio, **kw):
    cfg = load_config(env={}, **{"chunk_size": 32, "max_local_cpu_size": 0.05, "enable_blending": True,
                                 "blend_recompute_ratio": ratio, **kw})
    return LLM(str(model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory=64 << 20, enable_prefix_caching=False)


def _prompt_kv(llm, prompt):
    """Run a 1-token request (blended where lmkv holds its chunks) and return the prompt's KV
    from paged memory [2, L, n, H, D]."""
    eng = llm.engine
    req = eng.add_request(f"kv-{len(prompt)}-{eng.runner.num_forward_tokens}", prompt,
                          SamplingParams(max_tokens=1))
    req.capture_kv = True
    while not req.is_finished:
        eng.step()
    return req.captured_kv


def test_ratio_one_reproduces_full_prefill(tiny_model_dir, plain):
    docs, query = _docs()
    with _blend_llm(tiny_model_dir, 1.0) as llm:
        sep = llm.engine.blend_separator
        assert llm.precompute(docs, progress=False).stored == 3
        prompt = join_segments([docs[2], docs[0], docs[1], query], sep)
        out = llm.generate([prompt], GREEDY)[0]
        assert out.output_token_ids == plain.generate([prompt], GREEDY)[0].output_token_ids
        assert out.num_external_tokens == 210
        torch.testing.assert_close(_prompt_kv(llm, prompt), _prompt_kv(plain, prompt),
                                   atol=1e-5, rtol=1e-5)


def test_ratio_zero_is_naive_concatenation(tiny_model_dir, plain):
    docs, query = _docs(1)
    with _blend_llm(tiny_model_dir, 0.0) as llm:
        sep = llm.engine.blend_separator
        llm.precompute(docs, progress=False)
        stored = [plain.engine.compute_kv([d])[0] for d in docs]
        prompt = join_segments([docs[1], docs[2], query], sep)
        before = llm.engine.runner.num_forward_tokens
        kv = _prompt_kv(llm, prompt)  # [2, L, n, H, D]
        segs = split_segments(prompt, sep)
        uncached = len(prompt) - len(docs[1]) - len(docs[2])
        assert llm.engine.runner.num_forward_tokens - before == uncached  # nothing recomputed
        inv_freq = llm.engine.model.model.rope.inv_freq
        for seg, doc_kv in zip(segs[:2], [stored[1], stored[2]], strict=True):
            delta = torch.full((seg.length,), seg.start)
            for layer in range(kv.shape[1]):
                torch.testing.assert_close(kv[1, layer, seg.start : seg.end], doc_kv[1, layer])
                want_k = rerotate_keys(doc_kv[0, layer].clone(), delta, inv_freq)
                torch.testing.assert_close(kv[0, layer, seg.start : seg.end], want_k)
        # a chunk at offset 0 is an exact prefix: naive reuse then equals a full prefill
        head = join_segments([docs[0], query], sep)
        assert (llm.generate([head], GREEDY)[0].output_token_ids
                == plain.generate([head], GREEDY)[0].output_token_ids)


@pytest.fixture(scope="module")
def llama3_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with Llama-3 RoPE scaling (another config: another model for lmkv)."""
    out = tmp_path_factory.mktemp("llama3") / "model"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("scaled", [False, True], ids=["rope", "llama3_rope"])
def test_pre_rope_chunks_are_rotated_to_wherever_they_appear(tiny_model_dir, llama3_model_dir,
                                                              scaled):
    """With blend_store_pre_rope, chunks are reused after prefixes of any length: their keys
    (ratio 0: loaded as stored) equal the chunk's own keys rotated to the new positions, and
    at layer 0 (where a key depends on its token alone) the keys a full prefill computes."""
    model_dir = llama3_model_dir if scaled else tiny_model_dir
    docs, query = _docs(2)
    plain = LLM(str(model_dir), kv_cache_memory=64 << 20, enable_prefix_caching=False)
    alone = [plain.engine.compute_kv([d], pre_rope=True)[0] for d in docs[:2]]
    rope = plain.engine.model.model.rope
    with _blend_llm(model_dir, 0.0, blend_store_pre_rope=True) as llm:
        sep = llm.engine.blend_separator
        llm.precompute(docs, progress=False)
        for prefix_len in (3, 250):
            prompt = join_segments([list(range(10, 10 + prefix_len)), docs[1], docs[0], query], sep)
            kv = _prompt_kv(llm, prompt)  # [2, L, n, H, D]
            full = _prompt_kv(plain, prompt)
            segs = split_segments(prompt, sep)
            for seg, raw in zip(segs[1:3], [alone[1], alone[0]], strict=True):
                rows = slice(seg.start, seg.end)
                at = torch.arange(seg.start, seg.end)
                torch.testing.assert_close(kv[1, :, rows], raw[1])
                torch.testing.assert_close(kv[0, :, rows], rope.rotate(raw[0], at))
                torch.testing.assert_close(kv[:, 0, rows], full[:, 0, rows], atol=1e-5, rtol=1e-5)
        reg = llm.engine.metrics.registry
        # both prompts reused both chunks
        assert reg.get_sample_value("lmkv_blend_hit_tokens_total") == 2 * (70 + 40)
    plain.close()


def test_pre_rope_blend_at_ratio_one_reproduces_full_prefill(tiny_model_dir, plain):
    docs, query = _docs(3)
    with _blend_llm(tiny_model_dir, 1.0, blend_store_pre_rope=True) as llm:
        llm.precompute(docs, progress=False)
        prompt = join_segments([[5, 6, 7], docs[2], docs[0], query], llm.engine.blend_separator)
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_external_tokens == 170
        assert out.output_token_ids == plain.generate([prompt], GREEDY)[0].output_token_ids
        torch.testing.assert_close(_prompt_kv(llm, prompt), _prompt_kv(plain, prompt),
                                   atol=1e-5, rtol=1e-5)


def test_partial_recompute_text_prompts_metrics_and_idempotent_precompute(tiny_model_dir, capsys):
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        tok = llm.tokenizer
        docs = ["def parse(config): return config.items() " * 8, "The exception is raised when " * 10]
        report = llm.precompute(docs, batch_size=1)
        assert (report.stored, report.skipped) == (2, 0)
        lines = capsys.readouterr().err.splitlines()  # a line per batch, the last once
        assert [line.split(",")[0] for line in lines] == ["precompute: 1/2 documents",
                                                         "precompute: 2/2 documents"]
        again = llm.precompute(docs)
        assert (again.stored, again.skipped) == (0, 2)
        lines = capsys.readouterr().err.splitlines()  # one batch: its line
        assert [line.split(",")[0] for line in lines] == ["precompute: 2/2 documents"]
        text = " # # ".join(["You answer questions.", docs[1], docs[0], "What is raised?"])
        out = llm.generate([text], GREEDY)[0]
        assert out.num_external_tokens == len(tok.encode(docs[0], add_special_tokens=False)) + len(
            tok.encode(docs[1], add_special_tokens=False))
        reg = llm.engine.metrics.registry
        assert reg.get_sample_value("lmkv_blend_hit_tokens_total") == out.num_external_tokens
        recomputed = reg.get_sample_value("lmkv_blend_recomputed_tokens_total")
        assert recomputed == round(0.15 * out.num_external_tokens)
        llm.engine.kv_connector.cache.pool.check_integrity()
        # a prompt whose chunks were never precomputed takes the normal path
        miss = llm.generate([" # # ".join(["other text", "never stored", "q"])], GREEDY)[0]
        assert miss.num_external_tokens == 0


def test_a_blank_line_separator_keeps_the_prompt_tokenized_as_running_text(tiny_model_dir):
    """A byte-level BPE makes "\\n\\n" alone one token that running text never has (there it
    is two "\\n" before the next word); the blending engine joins the parts with the
    separator's running-text ids, so the prompt it tokenizes part by part is the prompt the
    model would see without blending, and a separator that does not split cleanly keeps
    its ids alone."""
    text = "Document 1: Zorvia. Its capital is Melk.\n\nThe river of it is Tal.\n\nQ: The river of"
    with _blend_llm(tiny_model_dir, 0.15, blend_special_str="\n\n") as llm:
        tok = llm.tokenizer
        assert tok.encode("\n\n", add_special_tokens=False) != llm.engine.blend_separator
        assert llm.engine.tokenize(text) == tok.encode(text)
        assert len(split_segments(llm.engine.tokenize(text), llm.engine.blend_separator)) == 3
    with _blend_llm(tiny_model_dir, 0.15) as llm:  # " # # ": its trailing space joins the next word
        assert llm.engine.blend_separator == llm.tokenizer.encode(" # # ", add_special_tokens=False)


def test_rag_request_through_engine_serve_after_cli_precompute(tiny_model_dir, tmp_path):
    """`engine precompute` stores two documents; `engine serve` then blends them into a RAG
    prompt given in the other order, and exports the hit counts."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    from .test_api_server import engine_command, free_port, metrics

    config = tmp_path / "lmkv.yaml"
    config.write_text(f"chunk_size: 32\nmax_local_cpu_size: 0.05\nlocal_disk: {tmp_path / 'disk'}\n"
                      "max_local_disk_size: 0.1\nenable_blending: true\n")
    docs = ["The river Tal flows through Zorvia and feeds its capital. " * 4,
            "Melk is the capital of Zorvia, famous for its old bridges. " * 4]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs) + "\n")  # as editors end a file
    env = {**os.environ, "LMKV_CONFIG_FILE": str(config)}
    common = ["--model", str(tiny_model_dir), "--kv-cache-memory", "32MiB"]
    out = subprocess.run(engine_command("precompute", *common, str(tmp_path / "docs.txt"),
                                        "--split-on", "\n\n"),
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 chunks stored" in out.stdout

    port = free_port()
    proc = subprocess.Popen(engine_command("serve", *common, "--port", str(port),
                                           "--log-level", "warning"),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        prompt = " # # ".join(["Answer from the documents.", docs[1], docs[0],
                               "Q: What is the capital of Zorvia? A:"])
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        m = metrics(url)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
        both = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
        assert m["lmkv_blend_hit_tokens_total"] == both  # the file's last chunk too
        assert m["lmkv_tier_hits_total{tier=disk}"] > 0  # served from the disk tier
        assert m["lmkv_blend_recomputed_tokens_total"] > 0
    finally:
        proc.terminate()
        proc.wait(30)
    del sys


def test_the_selection_function_picks_the_recomputed_tokens(tiny_model_dir, plain):
    """blend_prefill's ``select`` (benchmarks/blend_deviation.py's oracle goes through it):
    selecting every token is a full prefill; the default selects the ratio's share."""
    from lmkv.blend.plan import select_recompute
    from lmkv_engines.minimal.blend import blend_prefill

    docs, query = _docs(2)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        eng = llm.engine
        llm.precompute(docs, progress=False)
        prompt = join_segments([docs[1], docs[0], docs[2], query], eng.blend_separator)
        n, attn = len(prompt), eng.model.model.layers[0].self_attn
        asked = []

        def run(select):
            plan = eng.kv_connector.cache.blend_plan(prompt, eng.blend_separator)
            kv = torch.zeros(len(eng.model.model.layers), 2, n, 1, attn.num_kv_heads, attn.head_dim)
            try:
                _, recomputed = blend_prefill(eng.model, kv, prompt, torch.arange(n), plan,
                                              select=select)
            finally:
                plan.release()
            return kv[:, :, :, 0].transpose(0, 1), recomputed

        kv, recomputed = run(lambda deviation, cached, ratio: torch.ones_like(cached))
        assert recomputed == 210
        torch.testing.assert_close(kv, _prompt_kv(plain, prompt), atol=1e-5, rtol=1e-5)
        _, recomputed = run(lambda *a: asked.append(a[2]) or select_recompute(*a))
        assert asked == [0.15] and recomputed == round(0.15 * 210)


@pytest.mark.parametrize("ratio", [0.0, 0.15])
def test_a_blended_prefill_reads_no_device_value_after_the_check_layer(model_cache_dir, monkeypatch, ratio):
    """On a GPU every read of a device value into Python is a host sync: after the check
    layer picked the tokens, the layers read none (the attention's query groups are known on
    the host). Counted here as tensor-to-Python conversions, copies to the host and boolean
    mask indexing once the next layer starts,
    outside the cache writes (on a device their kernel runs, unchecked; the torch reference
    run here looks for skipped slots)."""
    from lmkv_engines.minimal.demo_model import DemoGeometry, ensure_demo_model

    model_dir = ensure_demo_model(DemoGeometry(  # 3 layers: one after the check layer
        hidden_size=128, intermediate_size=256, num_layers=3, num_heads=2, num_kv_heads=1,
        head_dim=64, max_position_embeddings=4096), cache_dir=model_cache_dir)
    docs, query = _docs(2)
    with _blend_llm(model_dir, ratio, blend_check_layer=1) as llm:
        eng = llm.engine
        llm.precompute(docs, progress=False)
        prompt = join_segments([docs[1], docs[0], docs[2], query], eng.blend_separator)
        layers = eng.model.model.layers
        plan = eng.kv_connector.cache.blend_plan(prompt, eng.blend_separator)
        after = plan.check_layer + 1 if ratio else 0
        assert after < len(layers)
        reads, counting = [], []
        def masked(index) -> bool:  # a boolean mask as an index: its nonzero is a host read
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)

        for name in ("__int__", "__bool__", "__float__", "item", "tolist", "cpu", "nonzero",
                     "__getitem__", "__setitem__"):
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **kw):
                if counting and (not _name.endswith("item__") or masked(a[0])):
                    reads.append(_name)
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)
        layers[after].input_layernorm.register_forward_pre_hook(lambda *_: counting.append(1))
        from lmkv_engines.minimal import blend

        def write(*a, _real=blend.reshape_and_cache, **kw):
            held = counting[:]
            counting.clear()
            try:
                return _real(*a, **kw)
            finally:
                counting.extend(held)

        monkeypatch.setattr(blend, "reshape_and_cache", write)
        n, attn = len(prompt), layers[0].self_attn
        kv = torch.zeros(len(layers), 2, n, 1, attn.num_kv_heads, attn.head_dim)
        try:
            _, recomputed = blend.blend_prefill(eng.model, kv, prompt, torch.arange(n), plan)
        finally:
            plan.release()
        assert counting and (0 < recomputed < n if ratio else recomputed == 0) and reads == []


def _refs(cache, keys):
    return [cache.storage.hot.entries[k].ref_count for k in keys]


def test_a_blend_lookup_that_raises_costs_a_recompute_not_the_step(tiny_model_dir, plain, tmp_path):
    """A tier read that raises while a blended prompt's chunks are fetched (a decoder's bug):
    that prompt is computed whole (the same tokens as without lmkv), the request beside it
    finishes, the chunks already fetched for earlier segments are given back, and the error
    is counted."""
    docs, query = _docs(4)
    with _blend_llm(tiny_model_dir, 0.15, local_disk=str(tmp_path), max_local_disk_size=0.05) as llm:
        eng, cache = llm.engine, llm.engine.kv_connector.cache
        llm.precompute(docs, progress=False)
        for key in cache.content_keys(docs[1]):  # docs[1] only on disk
            cache.storage.hot.entries.pop(key).release()
            cache.storage.hot.policy.removed(key)

        def broken(keys, bufs, absent=None):
            raise ValueError("a decoder's bug")

        cache.storage.tiers[0].read = broken
        prompt = join_segments([docs[0], docs[1], query], eng.blend_separator)
        bystander = list(range(10, 60))
        outs = llm.generate([prompt, bystander], GREEDY)
        want = plain.generate([prompt, bystander], GREEDY)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in want]
        assert _refs(cache, cache.content_keys(docs[0])) == [1, 1, 1]
        reg = eng.metrics.registry
        assert reg.get_sample_value("lmkv_errors_total", {"tier": "connector", "kind": "blend"}) == 1
        assert not eng.has_unfinished_requests()


def test_a_failed_blended_step_gives_back_every_plan(tiny_model_dir, monkeypatch):
    """Two blended prefills in one step, the first raising (a device out of memory): the
    step fails, and once its requests are aborted (as the server does) no stored chunk is
    still held for them."""
    import lmkv_engines.minimal.model_runner as model_runner

    docs, query = _docs(5)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        eng, cache = llm.engine, llm.engine.kv_connector.cache
        llm.precompute(docs, progress=False)
        keys = [k for d in docs for k in cache.content_keys(d)]
        real, calls = model_runner.blend_prefill, []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("out of memory (injected)")
            return real(*args, **kwargs)

        monkeypatch.setattr(model_runner, "blend_prefill", flaky)
        eng.add_request("a", join_segments([docs[0], query], eng.blend_separator), GREEDY)
        eng.add_request("b", join_segments([docs[1], docs[2], query], eng.blend_separator), GREEDY)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        for rid in list(eng.requests):
            eng.abort_request(rid)
        assert _refs(cache, keys) == [1] * len(keys)
        cache.pool.check_integrity()


def test_blend_metrics_count_a_prompt_once_while_it_waits_for_blocks(tiny_model_dir):
    """A blended prompt that waits steps for KV blocks is counted once, when it runs."""
    docs, query = _docs(6)
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.05, enable_blending=True)
    with LLM(str(tiny_model_dir), lmkv_config=cfg, num_kv_blocks=20, enable_prefix_caching=False) as llm:
        llm.precompute(docs, progress=False)
        prompt = join_segments([docs[2], docs[0], query], llm.engine.blend_separator)
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        outs = llm.generate([list(range(10, 200)), prompt], [long, GREEDY])
        assert outs[1].num_external_tokens == 170
        reg = llm.engine.metrics.registry
        assert reg.get_sample_value("lmkv_blend_requests_total") == 1
        assert reg.get_sample_value("lmkv_blend_hit_tokens_total") == 170
        # the prefix path's lookups too: the first prompt once, not once per step
        assert reg.get_sample_value("lmkv_lookups_total") == 1


def test_precompute_tokenizes_chunks_as_prompts_hold_them(tiny_model_dir, tmp_path):
    """With a tokenizer that adds BOS, a precomputed text chunk is still found inside a
    prompt (where it has no BOS of its own); it is computed alone, with nothing stored as
    prefix chunks."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    model = tmp_path / "bos-model"
    shutil.copytree(tiny_model_dir, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    tok.save(str(model / "tokenizer.json"))
    texts = ["def parse(config): return config.items() " * 8, "The exception is raised when " * 10]
    with _blend_llm(model, 0.15) as llm:
        assert llm.engine.tokenize(texts[0])[0] == bos  # prompts do get a BOS
        report = llm.precompute(texts, progress=False)
        assert (report.stored, report.skipped) == (2, 0)
        reg = llm.engine.metrics.registry
        pieces = sum(len(llm.engine.kv_connector.cache.content_keys(
            llm.engine.tokenize(t, add_special_tokens=False))) for t in texts)
        assert reg.get_sample_value("lmkv_stored_chunks_total") == pieces  # no prefix chunks
        prompt = " # # ".join(["You answer questions.", texts[1], texts[0], "What is raised?"])
        out = llm.generate([prompt], GREEDY)[0]
        want = sum(len(llm.engine.tokenize(t, add_special_tokens=False)) for t in texts)
        assert out.num_external_tokens == want


def test_precompute_counts_what_it_could_not_store_and_leaves_nothing_behind(tiny_model_dir):
    """A document the engine refuses is counted failed (the others are stored) and leaves
    no request behind; a write that no tier below the hot cache took counts as failed;
    repeats and empty documents are not computed; bad arguments are refused by name."""
    docs, query = _docs(7)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        report = llm.precompute([docs[0], [1, 2, 99999], docs[1], docs[0], []], progress=False)
        assert (report.stored, report.skipped, report.failed) == (2, 1, 1)
        assert not llm.engine.has_unfinished_requests()
        assert len(llm.generate([query], GREEDY)[0].output_token_ids) == 8
        with pytest.raises(ValueError, match="batch_size"):
            llm.precompute([docs[2]], batch_size=0)
        with pytest.raises(TypeError, match="list of texts"):
            llm.precompute("one text", progress=False)
    with _blend_llm(tiny_model_dir, 0.15, remote_url="lm://127.0.0.1:9") as llm:  # nobody there
        report = llm.precompute(docs, progress=False)
        assert (report.stored, report.failed) == (0, 3)


def test_precompute_again_stores_what_a_tier_below_lost(tiny_model_dir, tmp_path):
    """A chunk the hot cache holds but the disk tier lost (evicted for its size cap) is not
    "already stored": a process started later would not find it. Running precompute again
    stores it (before, it was skipped as stored and lost with the process)."""
    docs, _ = _docs(9)
    with _blend_llm(tiny_model_dir, 0.15, local_disk=str(tmp_path), max_local_disk_size=0.1) as llm:
        assert llm.precompute(docs, progress=False).stored == 3
        cache = llm.engine.kv_connector.cache
        cache.storage.tiers[0].backend.remove(cache.content_keys(docs[0]))
        report = llm.precompute(docs, progress=False)
        assert (report.stored, report.skipped, report.failed) == (1, 2, 0)
        assert all(cache.storage.tiers[0].contains(cache.content_keys(d)) == [True] * len(
            cache.content_keys(d)) for d in docs)


def test_computed_tokens_of_a_blended_prompt_are_those_the_model_ran(tiny_model_dir):
    """engine_computed_tokens_total counts what the model computed: for a blended prompt
    its uncached and recomputed tokens, not the reused ones too."""
    docs, query = _docs(11)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        llm.precompute(docs, progress=False)
        prompt = join_segments([docs[0], docs[1], query], llm.engine.blend_separator)
        reg = llm.engine.metrics.registry
        before = reg.get_sample_value("engine_computed_tokens_total")
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
        counted = reg.get_sample_value("engine_computed_tokens_total") - before
        reused = out.num_external_tokens
        recomputed = reg.get_sample_value("lmkv_blend_recomputed_tokens_total")
        assert reused == len(docs[0]) + len(docs[1]) and recomputed > 0
        assert counted == len(prompt) - reused + recomputed


def test_precompute_names_a_file_that_is_not_text_and_warns_when_blending_is_off(tiny_model_dir,
                                                                                  tmp_path):
    import os
    import subprocess

    from .test_api_server import engine_command

    config = tmp_path / "lmkv.yaml"
    config.write_text(f"chunk_size: 32\nlocal_disk: {tmp_path / 'disk'}\nmax_local_disk_size: 0.1\n")
    env = {**os.environ, "LMKV_CONFIG_FILE": str(config)}
    (tmp_path / "bad.txt").write_bytes(b"caf\xff\n")
    out = subprocess.run(engine_command("precompute", "--model", str(tiny_model_dir),
                                        str(tmp_path / "bad.txt")),
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"{tmp_path / 'bad.txt'} is not UTF-8 text" in out.stderr
    assert "enable_blending is off" in out.stderr


def test_a_rag_prompt_sent_again_or_continued_reuses_its_blended_pages(tiny_model_dir, plain):
    """The engine files a RAG prompt's pages under a blend namespace: the same prompt again,
    or a chat's next turn over the same documents, is served from them (as a blend again
    would, not recomputed nor blended again), saves nothing to lmkv as exact prefix chunks,
    and an exact request with the same leading tokens never reads them."""
    docs, query = _docs(7)
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.05, enable_blending=True,
                      blend_recompute_ratio=0.15)
    with LLM(str(tiny_model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20) as llm:
        eng, sep = llm.engine, llm.engine.blend_separator
        llm.precompute(docs, progress=False)
        header = list(range(300, 340))  # a system prompt: not precomputed
        prompt = join_segments([header, docs[2], docs[0], docs[1], query], sep)
        first = llm.generate([prompt], GREEDY)[0]
        reg = eng.metrics.registry
        assert reg.get_sample_value("lmkv_blend_requests_total") == 1
        before = eng.runner.num_forward_tokens
        again = llm.generate([prompt], GREEDY)[0]
        assert again.output_token_ids == first.output_token_ids
        assert again.num_cached_tokens == len(prompt) // 16 * 16  # the engine's blocks of 16
        assert eng.runner.num_forward_tokens - before == len(prompt) - again.num_cached_tokens + 7
        turn = prompt + first.output_token_ids + query[:5]  # the next turn of the chat
        nxt = llm.generate([turn], GREEDY)[0]
        assert nxt.num_cached_tokens >= len(prompt) // 16 * 16
        assert reg.get_sample_value("lmkv_blend_requests_total") == 1  # never blended again
        cache = eng.kv_connector.cache
        cache.drain()
        assert cache.lookup(cache.keys(turn)) == 0  # no chunk computed over blended KV saved
        # an exact prompt that starts as the RAG prompt does: none of its pages
        exact = header + query
        out = llm.generate([exact], GREEDY)[0]
        assert out.num_cached_tokens == 0
        assert out.output_token_ids == plain.generate([exact], GREEDY)[0].output_token_ids


def _many_docs(seed: int, n: int = 60, length: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (length,), generator=g).tolist() for _ in range(n)]


def test_precompute_past_the_hot_cache_counts_only_what_stayed(tiny_model_dir):
    """With no tier below, chunks that later ones evicted from the hot cache were counted
    stored (60 stored, 15 held): they are failures, and a warning says why."""
    docs = _many_docs(3)
    with _blend_llm(tiny_model_dir, 0.15, max_local_cpu_size=0.001) as llm:  # 30 slots
        report = llm.precompute(docs, progress=False)
        held = sum(llm.engine.kv_connector.cache.has_chunk(d) for d in docs)
        assert held < len(docs) and (report.stored, report.failed) == (held, len(docs) - held)


def test_precompute_waits_for_a_slow_tier_batch_by_batch(tiny_model_dir, tmp_path):
    """Writes queued behind a tier slower than the computation were dropped for the next
    chunks' slots (15 of 60 reached the disk): each batch's writes are waited for."""
    import time

    docs = _many_docs(4)
    with _blend_llm(tiny_model_dir, 0.15, max_local_cpu_size=0.001, local_disk=str(tmp_path),
                    max_local_disk_size=1) as llm:
        backend = llm.engine.kv_connector.cache.storage.tiers[0].backend
        real = backend.put
        backend.put = lambda items: (time.sleep(0.02), real(items))[1]
        report = llm.precompute(docs, progress=False)
        assert (report.stored, report.failed) == (len(docs), 0)


def test_precompute_takes_the_documents_a_batch_at_a_time(tiny_model_dir):
    """Every document was tokenized and held before the first was computed."""
    docs, read = _many_docs(5, n=50, length=40), []

    class Docs(list):
        def __getitem__(self, i):
            read.append(i)
            return list.__getitem__(self, i)

        def __iter__(self):
            return (self[i] for i in range(len(self)))

    with _blend_llm(tiny_model_dir, 0.15) as llm:
        real, first = llm.engine.compute_kv, []
        llm.engine.compute_kv = lambda lists, pre_rope=False: (first.append(len(read)),
                                                               real(lists, pre_rope))[1]
        assert llm.precompute(Docs(docs), batch_size=8, progress=False).stored == 50
        assert first[0] == 8


def test_a_document_holding_the_separator_is_named_and_not_stored(tiny_model_dir, caplog):
    """Prompts split at the separator, so such a document is never found whole: it costs
    neither the compute nor a slot, and counts as failed."""
    docs, _ = _docs(15)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        doc = docs[0][:30] + llm.engine.blend_separator + docs[0][30:]
        text = "A document # # that holds the separator."
        with caplog.at_level("WARNING"):
            report = llm.precompute([doc, text, docs[1]], progress=False)
        assert (report.stored, report.failed) == (1, 2)
        assert not llm.engine.kv_connector.cache.has_chunk(doc)
    messages = [r.getMessage() for r in caplog.records]
    assert any("document 0 holds the separator's ids" in m for m in messages)
    assert any("document 1 contains the separator ' # # '" in m for m in messages)


def test_precompute_with_blending_off_says_so(tiny_model_dir, caplog):
    docs, _ = _docs(16)
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.05)
    with (LLM(str(tiny_model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20) as llm,
          caplog.at_level("WARNING")):
        llm.precompute(docs[:1], progress=False)
    assert any("enable_blending is off" in r.getMessage() for r in caplog.records)


def test_a_rag_prompt_whose_documents_are_on_a_slow_tier_does_not_stall_the_running_ones(
        tiny_model_dir, tmp_path):
    """A RAG prompt arrives while another request decodes, its documents on a slow lower
    tier: they are prefetched at arrival and the prompt waits while they come up, as a
    prefix prompt does (before, admitting it fetched them on the scheduling thread, one
    document after another, and every running request waited: 2.0 s steps here)."""
    import time

    docs, query = _docs(14)
    with _blend_llm(tiny_model_dir, 0.15, local_disk=str(tmp_path), max_local_disk_size=0.1) as llm:
        separator = llm.engine.blend_separator
        llm.precompute(docs, progress=False)
        prompt = join_segments([[7, 8], *docs, query], separator)
        want = llm.generate([prompt], GREEDY)[0]  # (read from the hot cache)
        lmkv = llm.engine.kv_connector.cache
        lmkv.storage.hot.clear()
        disk = lmkv.storage.tiers[0].backend
        real = disk.get_into_many
        disk.get_into_many = lambda *a, **k: (time.sleep(0.5), real(*a, **k))[1]
        engine = llm.engine
        engine.add_request("other", list(range(300, 340)),
                           SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
        while not engine.scheduler.running:
            engine.step()
        engine.add_request("rag", prompt, GREEDY)  # its documents' prefetch starts now
        steps, done = [], None
        while done is None:
            start = time.perf_counter()
            done = next((o for o in engine.step() if o.finished), None)
            steps.append(time.perf_counter() - start)
        engine.abort_request("other")
        assert done.request_id == "rag" and done.output_token_ids == want.output_token_ids
        assert done.num_external_tokens == want.num_external_tokens == sum(map(len, docs))
        assert max(steps) < 0.4, f"a step waited {max(steps):.2f} s for the slow tier"


def test_the_deviation_that_picks_the_recomputed_tokens_does_not_overflow_in_float16(tiny_model_dir):
    """Summed over heads, squares of float16 keys overflowed to inf: among such tokens the
    choice was arbitrary. The deviation is taken in float32."""
    from lmkv_engines.minimal.blend import blend_prefill

    docs, query = _docs(3)
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.05, enable_blending=True)
    with LLM(str(tiny_model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20,
             enable_prefix_caching=False, dtype="float16") as llm:
        eng = llm.engine
        with torch.no_grad():
            check = eng.model.model.layers[llm.engine.kv_connector.cache.config.blend_check_layer]
            k_proj = check.self_attn.k_proj.weight  # the check layer's keys in the hundreds
            k_proj.mul_(30 / k_proj.abs().max())
        llm.precompute(docs, progress=False)
        prompt = join_segments([docs[1], docs[0], query], eng.blend_separator)
        n, attn = len(prompt), eng.model.model.layers[0].self_attn
        seen = []
        plan = eng.kv_connector.cache.blend_plan(prompt, eng.blend_separator)
        kv = torch.zeros(len(eng.model.model.layers), 2, n, 1, attn.num_kv_heads, attn.head_dim,
                         dtype=torch.float16)
        try:
            blend_prefill(eng.model, kv, prompt, torch.arange(n), plan,
                          select=lambda deviation, cached, ratio: seen.append((deviation, cached))
                          or torch.ones_like(cached))
        finally:
            plan.release()
        deviation, cached = seen[0]
        assert bool(cached.any()) and bool(torch.isfinite(deviation[cached]).all())


def test_precompute_takes_documents_from_a_generator(tiny_model_dir, caplog):
    """`engine precompute` hands its files' chunks over one file at a time (a generator):
    no list of the whole corpus in memory."""
    docs, _ = _docs(16)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        report = llm.precompute((d for d in docs + docs[:1]), batch_size=2, progress=False)
        assert (report.stored, report.skipped, report.failed) == (3, 1, 0)
        assert all(llm.engine.kv_connector.cache.has_chunk(d) for d in docs)


def test_a_running_engine_finds_documents_precomputed_by_another_process(tiny_model_dir, tmp_path):
    """Documents added while serving (`engine precompute` into the server's disk tier) are
    reused at once, not only after a restart."""
    disk = dict(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1)
    docs, query = _docs()
    with _blend_llm(tiny_model_dir, 0.15, **disk) as server:  # serving first
        with _blend_llm(tiny_model_dir, 0.15, **disk) as other:  # then a precompute beside it
            assert other.precompute(docs[:1], progress=False).stored == 1
        prompt = join_segments([[7, 8, 9], docs[0], query], server.engine.blend_separator)
        assert server.generate([prompt], GREEDY)[0].num_external_tokens == len(docs[0])


def test_cli_chunks_lose_the_line_ends_around_them_and_a_byte_order_mark(tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    """`engine precompute --split-on $'\\n\\n'` over paragraphs separated by more than one
    blank line, in a file that starts with a byte-order mark: each chunk is stored as a
    prompt holds the paragraph (before, the extra newline and the mark were part of the
    chunk, which no prompt then matched)."""
    from lmkv_engines.minimal import cli

    cfg = tmp_path / "l.yaml"
    cfg.write_text(f"chunk_size: 32\nmax_local_cpu_size: 0.05\nlocal_disk: {tmp_path / 'd'}\n"
                   "max_local_disk_size: 0.1\nenable_blending: true\n")
    (tmp_path / "docs.txt").write_text("\ufeffAlpha is first.\n\n\nBeta is second.\n\n", encoding="utf-8")
    monkeypatch.setenv("LMKV_CONFIG_FILE", str(cfg))
    assert cli.main(["precompute", "--model", str(tiny_model_dir), "--kv-cache-memory", "32MiB",
                     str(tmp_path / "docs.txt"), "--split-on", "\n\n"]) == 0
    with _blend_llm(tiny_model_dir, 0.15, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1) as llm:
        cache = llm.engine.kv_connector.cache
        for doc in ("Alpha is first.", "Beta is second."):
            assert cache.has_chunk(llm.engine.tokenize(doc, add_special_tokens=False)), doc


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_blend_plan_the_connector_fails_to_take_costs_a_full_prefill(tiny_model_dir, plain, where):
    """lmkv raising as the engine takes a blend plan (before or after lmkv handed it over):
    the request is computed without lmkv (plain prefill's tokens, not blended on its next
    try either) and the plan's chunks go back to the pool."""
    docs, query = _docs(17)
    with _blend_llm(tiny_model_dir, 0.15) as llm:
        eng = llm.engine
        llm.precompute(docs, progress=False)
        prompt = join_segments([[300, 301, 302], docs[1], docs[0], query], eng.blend_separator)
        sched = eng.kv_connector.scheduler
        real = sched.update_state_after_alloc

        def failing(req, *args):
            sched.update_state_after_alloc = real
            if where == "after":
                real(req, *args)
            raise RuntimeError("injected")

        sched.update_state_after_alloc = failing
        out = llm.generate([prompt], GREEDY)[0]
        assert out.output_token_ids == plain.generate([prompt], GREEDY)[0].output_token_ids
        assert out.num_external_tokens == 0
        cache = eng.kv_connector.cache
        cache.pool.check_integrity()
        assert cache.pool.num_free + len(cache.storage.hot) == cache.pool.num_slots
        assert llm.generate([prompt], GREEDY)[0].num_external_tokens > 0  # blended again
