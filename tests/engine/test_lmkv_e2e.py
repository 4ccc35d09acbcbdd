"""With lmkv, the engine returns the same tokens as without it: from the hot cache, from
disk in a new process, under memory pressure, layer-wise, and when the disk misbehaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lmkv.streams import CopyStream
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

from .lmkv_workload import CHUNK, GREEDY, fail_once_at_layer, lmkv_llm, metric, prompts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Tokens of each prompt set without lmkv, one prompt at a time."""
    llm = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    cache: dict[int, list[list[int]]] = {}

    def tokens(seed: int = 0) -> list[list[int]]:
        if seed not in cache:
            cache[seed] = [llm.generate([p], GREEDY)[0].output_token_ids for p in prompts(seed=seed)]
        return cache[seed]

    return tokens


def _fill_disk(model_dir, disk, rounds=1, remote_url=None, role="both", full=False) -> list:
    extra = [remote_url or "-", role]
    out = subprocess.run(
        [sys.executable, "-m", "tests.engine.lmkv_workload", str(model_dir), str(disk), str(rounds),
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )
    rounds = [json.loads(line) for line in out.stdout.splitlines()]
    return [r["tokens"] for r in rounds] if not full else rounds


def _full_chunks(p: list[int]) -> int:
    return (len(p) - 1) // CHUNK * CHUNK


@pytest.mark.parametrize("layerwise", [False, True])
def test_hot_cache_hit_gives_same_tokens(tiny_model_dir, reference, layerwise):
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise) as llm:
        first = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in first] == reference()
        assert all(o.num_external_tokens == 0 for o in first)
        again = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in again] == reference()
        assert [o.num_external_tokens for o in again] == [_full_chunks(p) for p in prompts()]
        assert metric(llm, "lmkv_hit_tokens_total") == sum(_full_chunks(p) for p in prompts())
        assert metric(llm, "lmkv_tier_hits_total", tier="hot") > 0
        assert len(llm.engine.kv_connector.cache.pins) == 0  # every pin was taken by its load
        llm.engine.kv_connector.cache.pool.check_integrity()


def test_disk_hit_in_a_new_process(tiny_model_dir, reference, tmp_path):
    written = _fill_disk(tiny_model_dir, tmp_path / "disk")
    assert written[0] == reference()
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", enable_prefetch=False) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert [o.num_external_tokens for o in outs] == [_full_chunks(p) for p in prompts()]
        assert metric(llm, "lmkv_tier_hits_total", tier="disk") == sum(
            _full_chunks(p) // CHUNK for p in prompts())


def test_a_load_plan_the_connector_fails_to_take_costs_a_recompute_and_leaves_no_stale_pages(
        tiny_model_dir, reference, tmp_path):
    """lmkv raising as the engine takes its offer for a request (update_state_after_alloc):
    that request is computed without lmkv and the step goes on. Before, it left both queues
    with its blocks held and their prefix-cache hashes registered for tokens never computed:
    the same prompt again attended over those pages (other tokens), and its abort raised."""
    _fill_disk(tiny_model_dir, tmp_path / "disk")
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", enable_prefetch=False, prefix_caching=True) as llm:
        sched = llm.engine.kv_connector.scheduler
        real, calls = sched.update_state_after_alloc, []

        def failing_second(req, *args):
            calls.append(req.request_id)
            if len(calls) == 2:
                raise RuntimeError("injected")
            return real(req, *args)

        sched.update_state_after_alloc = failing_second
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert sorted(o.num_external_tokens == 0 for o in outs) == [False] * (len(outs) - 1) + [True]
        assert metric(llm, "lmkv_errors_total", tier="connector", kind="load") == 1
        assert [o.output_token_ids for o in llm.generate(prompts(), GREEDY)] == reference()
        blocks = llm.engine.block_manager
        blocks.check_integrity()
        assert blocks.num_free_blocks == blocks.num_blocks and not sched.states
        llm.engine.kv_connector.cache.pool.check_integrity()


def test_prefetch_pulls_queued_requests_from_disk(tiny_model_dir, reference, tmp_path):
    _fill_disk(tiny_model_dir, tmp_path / "disk")
    with lmkv_llm(tiny_model_dir, tmp_path / "disk") as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert metric(llm, "lmkv_prefetched_chunks_total") > 0
        assert all(o.num_external_tokens == _full_chunks(p) for o, p in zip(outs, prompts(), strict=True))


def test_partial_prefix_hits_and_engine_prefix_cache_together(tiny_model_dir, tmp_path):
    base = prompts(n=1, length=200, seed=5)[0]
    other = prompts(n=1, length=100, seed=6)[0]
    diverged = base[:100] + other  # shares chunks [0, 96) with base
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    want = {name: plain.generate([p], GREEDY)[0].output_token_ids
            for name, p in [("base", base), ("diverged", diverged), ("short", base[:50])]}
    _fill_disk_with = lmkv_llm(tiny_model_dir, tmp_path / "disk")
    _fill_disk_with.generate([base], GREEDY)
    _fill_disk_with.close()
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", prefix_caching=True) as llm:
        out = llm.generate([diverged], GREEDY)[0]
        assert out.output_token_ids == want["diverged"] and out.num_external_tokens == 96
        # the engine's prefix cache now holds blocks [0, 48) of a 50-token prompt; lmkv then
        # loads the rest of base's chunks, skipping the 16 tokens of chunk 1 the engine has
        short = llm.generate([base[:50]], GREEDY)[0]
        assert short.output_token_ids == want["short"]
        llm.engine.block_manager.reset_prefix_cache()
        llm.generate([base[:50]], GREEDY)
        out = llm.generate([base], GREEDY)[0]
        assert out.output_token_ids == want["base"]
        assert out.num_cached_tokens == 48 and out.num_external_tokens == 192 - 48


def test_chunks_the_engine_has_are_not_fetched_again(tiny_model_dir, tmp_path):
    """With the engine's prefix cache holding the first chunks, lmkv fetches (and prefetches)
    only the chunks beyond them from its tiers (and still counts the ones below as stored);
    a request that uses no cached KV prefetches nothing."""
    base = prompts(n=1, length=200, seed=7)[0]
    _fill = lmkv_llm(tiny_model_dir, tmp_path / "disk")
    want = _fill.generate([base], GREEDY)[0].output_token_ids
    _fill.close()
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", prefix_caching=True) as llm:
        lmkv = llm.engine.kv_connector.cache
        fetched: list[str] = []
        real_fetch = lmkv.fetch
        lmkv.fetch = (lambda keys, parent=None, again=False:
                      fetched.extend(keys) or real_fetch(keys, parent, again))
        prefetched: list[str] = []
        real_prefetch = lmkv.prefetch
        lmkv.prefetch = lambda keys, parent=None: prefetched.extend(keys) or real_prefetch(keys, parent)
        llm.generate([base[: 2 * CHUNK + 1]], GREEDY)  # chunks 0, 1 now in the engine's cache
        lmkv.storage.hot.clear()
        fetched.clear()
        prefetched.clear()
        out = llm.generate([base], GREEDY)[0]
        assert out.output_token_ids == want
        assert out.num_cached_tokens == 2 * CHUNK
        assert out.num_external_tokens == _full_chunks(base) - 2 * CHUNK
        stored = lmkv.keys(base[: _full_chunks(base)])
        assert fetched == stored[2:], "chunks below the engine's prefix hit were fetched again"
        assert prefetched == stored[2:], "chunks below the engine's prefix hit were prefetched"
        prefetched.clear()
        llm.engine.compute_kv([prompts(n=1, length=100, seed=8)[0]])  # (uses no cached KV)
        assert prefetched == []


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_prompt_of_whole_chunks_loads_all_but_its_last_token(tiny_model_dir, tmp_path, layerwise):
    """A prompt of whole chunks: the last chunk is loaded but for the last token (which is
    computed: it yields the first logits), so a repeated prompt computes one token; a second
    run finds every chunk stored and writes none again."""
    exact = prompts(n=1, length=4 * CHUNK, seed=8)[0]
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    want = plain.generate([exact], GREEDY)[0].output_token_ids
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", use_layerwise=layerwise) as llm:
        assert llm.generate([exact], GREEDY)[0].output_token_ids == want
        assert metric(llm, "lmkv_stored_chunks_total") == 4
        llm.engine.kv_connector.cache.storage.hot.clear()
        out = llm.generate([exact], GREEDY)[0]
        assert out.output_token_ids == want and out.num_external_tokens == 4 * CHUNK - 1
        assert metric(llm, "lmkv_loaded_tokens_total") == 4 * CHUNK - 1
        assert metric(llm, "lmkv_stored_chunks_total") == 4


def test_the_last_chunk_fills_the_engines_prefix_hit_up_to_the_last_token(tiny_model_dir, tmp_path):
    """The engine's prefix cache stops a block short of the prompt's end (its last block
    holds the last token); lmkv loads that block's other tokens from the stored last chunk."""
    exact = prompts(n=1, length=4 * CHUNK, seed=9)[0]
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", prefix_caching=True) as llm:
        want = llm.generate([exact], GREEDY)[0].output_token_ids
        out = llm.generate([exact], GREEDY)[0]
        block = llm.engine.block_manager.block_size
        assert out.output_token_ids == want
        assert out.num_cached_tokens == 4 * CHUNK - block
        assert out.num_external_tokens == block - 1


def test_many_concurrent_requests_under_memory_pressure(tiny_model_dir, reference):
    # 9 chunks of hot cache for 6 prompts of 6-7 chunks (and for their loads): constant
    # eviction; each prompt then sent twice in a row, after the others pushed its chunks
    # out (the second finds what the first left hot)
    chunk_bytes = 2 * 2 * CHUNK * 1 * 64 * 4
    with lmkv_llm(tiny_model_dir, cpu_gb=9.5 * (chunk_bytes + 64) / 1e9) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        for p, want in zip(prompts(), reference(), strict=True):
            outs = llm.generate([p], GREEDY) + llm.generate([p], GREEDY)
            assert [o.output_token_ids for o in outs] == [want, want]
        assert metric(llm, "lmkv_loaded_tokens_total") > 0  # (4 slots: nothing ever loaded)
        assert metric(llm, "lmkv_evictions_total", tier="hot") > 0
        llm.engine.kv_connector.cache.pool.check_integrity()
    with lmkv_llm(tiny_model_dir) as llm:  # ample memory, 12 requests in one batch
        many = prompts() + prompts(seed=1)
        outs = llm.generate(many, GREEDY)
        again = llm.generate(many, GREEDY)
        assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]
        assert [o.output_token_ids for o in outs[:6]] == reference()
        assert all(o.num_external_tokens > 0 for o in again)


def test_save_decode_cache_stores_generated_chunks(tiny_model_dir):
    p = prompts(n=1, length=60, seed=9)[0]
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    first = plain.generate([p], GREEDY)[0].output_token_ids
    cont = p + first  # 72 tokens: chunk [32, 64) was completed by generated tokens
    want = plain.generate([cont], GREEDY)[0].output_token_ids
    for decode, expect in [(False, 32), (True, 64)]:
        with lmkv_llm(tiny_model_dir, save_decode_cache=decode) as llm:
            llm.generate([p], GREEDY)
            out = llm.generate([cont], GREEDY)[0]
            assert out.output_token_ids == want and out.num_external_tokens == expect


def _corrupt(disk: Path, how: str) -> int:
    files = sorted(disk.glob("*.kv"))
    for f in files:
        data = bytearray(f.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
            data[100] ^= 0x01
        elif how == "truncate":
            data = data[: len(data) - 1000]
        f.write_bytes(bytes(data))
    return len(files)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_files_cost_a_recompute(tiny_model_dir, reference, tmp_path, how):
    _fill_disk(tiny_model_dir, tmp_path / "disk")
    assert _corrupt(tmp_path / "disk", how) > 0
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", enable_prefetch=False) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert all(o.num_external_tokens == 0 for o in outs)
        assert metric(llm, "lmkv_errors_total", tier="disk", kind="corrupt") > 0


def test_disk_cap_of_a_few_chunks(tiny_model_dir, reference, tmp_path):
    frame = 64 + 2 * 2 * CHUNK * 64 * 4
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", disk_gb=3.5 * frame / 1e9) as llm:
        llm.generate(prompts(), GREEDY)
        llm.engine.kv_connector.cache.storage.io.drain()
        assert len(list((tmp_path / "disk").glob("*.kv"))) == 3
        assert metric(llm, "lmkv_evictions_total", tier="disk") > 0
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", disk_gb=3.5 * frame / 1e9) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        last = prompts(n=1, length=100, seed=7)  # 3 chunks: what the capped tier can hold
        first = llm.generate(last, GREEDY)[0]
        assert first.num_external_tokens == 0  # computed: the tokens to match
        want = first.output_token_ids
        llm.engine.kv_connector.cache.storage.io.drain()
    with lmkv_llm(tiny_model_dir, tmp_path / "disk", disk_gb=3.5 * frame / 1e9) as llm:
        out = llm.generate(last, GREEDY)[0]  # read from the capped directory
        assert out.output_token_ids == want and out.num_external_tokens == 3 * CHUNK
        assert metric(llm, "lmkv_tier_hits_total", tier="disk") == 3


def test_sigkill_while_writing_leaves_only_intact_entries(tiny_model_dir, reference, tmp_path):
    """An engine killed (SIGKILL) half-way through writing a chunk's file: the next engine
    finds every file written before it whole, no entry for the one cut short (its temporary
    file swept), and the same tokens. (The kill used to land at a random moment, almost
    never inside a write: a write straight into the final file passed too.) A
    sitecustomize module in the child kills it during its 10th disk write."""
    disk, hook = tmp_path / "disk", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, signal
        from lmkv.backends import disk
        writes = []
        class HalfWritten:
            def __init__(self, f):
                self.f = f
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                return self.f.__exit__(*exc)
            def fileno(self):
                return self.f.fileno()
            def write(self, view):
                writes.append(len(view))
                if len(writes) == 10:
                    self.f.write(view[: len(view) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
                return self.f.write(view)
        def _open(path, mode="r", *args, **kwargs):
            f = open(path, mode, *args, **kwargs)
            return HalfWritten(f) if mode == "xb" else f
        disk.open = _open
    """))
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.lmkv_workload", str(tiny_model_dir), str(disk), "50"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert len(list(disk.glob("*.kv"))) == 9 and len(list(disk.glob(".*.tmp"))) == 1
    with lmkv_llm(tiny_model_dir, disk) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert sum(o.num_external_tokens for o in outs) > 0
        assert metric(llm, "lmkv_tier_hits_total", tier="disk") == 9
        assert metric(llm, "lmkv_errors_total", tier="disk", kind="corrupt") == 0
    assert not list(disk.glob(".*.tmp")) and not list(disk.glob("*.tmp"))


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_failed_load_is_recomputed_never_attended(tiny_model_dir, reference, layerwise):
    """A load that fails (at layer 1 of 2 in layer-wise mode) leaves pages of unknown
    contents: the requests holding them, including one that shares them through the
    engine's prefix cache in the same step, are recomputed, none of their chunks computed
    that step is stored, and the same tokens come out as without lmkv."""
    ps = prompts()
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise, prefix_caching=True) as llm:
        llm.generate(ps, GREEDY)  # stores every full chunk
        llm.engine.block_manager.reset_prefix_cache()  # so that lmkv, not the engine, serves them
        worker = llm.engine.kv_connector.worker
        real_load, failures = worker.paged.load, []

        def broken(kv, slots, skip, layer=None):
            if layer in (None, 1):
                failures.append(layer)
                raise OSError("injected load failure")
            return real_load(kv, slots, skip, layer)

        worker.paged.load = broken
        stored = metric(llm, "lmkv_stored_chunks_total")
        outs = llm.generate(ps + ps[:1], GREEDY)  # the repeat shares the first prompt's pages
        worker.paged.load = real_load
        assert failures, "the injected failure never ran"
        assert [o.output_token_ids for o in outs] == reference() + reference()[:1]
        assert all(o.num_external_tokens == 0 for o in outs)
        assert metric(llm, "lmkv_errors_total", tier="connector", kind="load") >= 1
        assert metric(llm, "lmkv_loaded_tokens_total") == 0
        assert metric(llm, "lmkv_stored_chunks_total") == stored  # all were stored already
        llm.engine.block_manager.check_integrity()
        llm.engine.kv_connector.cache.pool.check_integrity()
        # nothing stale was left in the engine's prefix cache or in lmkv
        llm.engine.block_manager.reset_prefix_cache()
        again = llm.generate(ps, GREEDY)
        assert [o.output_token_ids for o in again] == reference()
        assert [o.num_external_tokens for o in again] == [_full_chunks(p) for p in ps]


def _alone(model_dir, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens without lmkv, one at a time."""
    llm = LLM(str(model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    return [llm.generate([p], GREEDY)[0].output_token_ids for p in ps]


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_failed_load_leaves_nothing_stale_in_the_engines_prefix_cache(tiny_model_dir, layerwise):
    """The blocks a request computed in the step whose load failed (over unfilled pages)
    were registered in the engine's prefix cache at allocation: they are dropped with the
    load's own, so the same prompt again (the engine's prefix cache on, not reset) gives the
    tokens of a run without lmkv."""
    p = prompts(n=1, length=200, seed=3)[0]
    g = torch.Generator().manual_seed(99)
    a = p[: 6 * CHUNK] + torch.randint(5, 4096, (120,), generator=g).tolist()  # 6 chunks + 120 new
    want = _alone(tiny_model_dir, [a])[0]
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise, prefix_caching=True) as llm:
        llm.generate([p], GREEDY)  # lmkv stores p's chunks
        llm.engine.block_manager.reset_prefix_cache()  # lmkv, not the engine, serves them
        worker = llm.engine.kv_connector.worker
        real_load, failures = worker.paged.load, []

        def broken(kv, slots, skip, layer=None):
            failures.append(layer)
            raise OSError("injected load failure")

        worker.paged.load = broken
        assert llm.generate([a], GREEDY)[0].output_token_ids == want  # recomputed
        worker.paged.load = real_load
        assert failures
        again = llm.generate([a], GREEDY)[0]  # through the engine's prefix cache as it is
        assert again.num_cached_tokens > 0
        assert again.output_token_ids == want
        llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_forward_pass_that_fails_stores_nothing(tiny_model_dir, layerwise):
    """A forward pass that raises halfway (an OOM, say) wrote some pages only: none of the
    step's chunks is stored (they would be loaded by every later request with that prefix),
    and the pool gets its buffers back."""
    p = prompts(n=1, length=200, seed=7)[0]
    want = _alone(tiny_model_dir, [p])[0]
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise) as llm:
        fail_once_at_layer(llm, 1)
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate([p], GREEDY)
        for rid in list(llm.engine.requests):  # what the API server does with a failed step
            llm.engine.abort_request(rid)
        assert metric(llm, "lmkv_stored_chunks_total") == 0
        llm.engine.kv_connector.cache.pool.check_integrity()
        out = llm.generate([p], GREEDY)[0]
        assert out.output_token_ids == want and out.num_external_tokens == 0


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("where", ["gather", "pin"])
def test_a_failed_save_costs_a_later_recompute_not_the_request(tiny_model_dir, layerwise, where):
    """Gathering the new chunks fails, or pinning a slot mapping for them (a pinned
    allocation on a GPU; layer-wise, inside the forward pass): the request still gets its
    tokens; lmkv counts the error and stores nothing."""
    p = prompts(n=1, length=200, seed=5)[0]
    want = _alone(tiny_model_dir, [p])[0]
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise) as llm:
        worker = llm.engine.kv_connector.worker

        def broken(*args, **kwargs):
            raise OSError("injected save failure")

        if where == "gather":
            worker.paged.save = broken
        else:
            worker._pinned = broken
        assert llm.generate([p], GREEDY)[0].output_token_ids == want
        assert metric(llm, "lmkv_errors_total", tier="connector", kind="save") >= 1
        assert metric(llm, "lmkv_stored_chunks_total") == 0
        llm.engine.kv_connector.cache.pool.check_integrity()


def test_a_lookup_that_raises_costs_that_request_a_recompute(tiny_model_dir, reference):
    """lmkv's lookup raising (a bug, not a failed tier: those are misses) is that request's
    miss, counted; the step and the other requests go on."""
    ps = prompts()
    with lmkv_llm(tiny_model_dir) as llm:
        llm.generate(ps, GREEDY)
        sched = llm.engine.kv_connector.scheduler
        real = sched.get_num_new_matched_tokens

        def broken(req, num_computed):
            if req.prompt_token_ids == ps[0]:
                raise RuntimeError("injected lookup bug")
            return real(req, num_computed)

        sched.get_num_new_matched_tokens = broken
        outs = llm.generate(ps, GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert outs[0].num_external_tokens == 0 and outs[1].num_external_tokens > 0
        assert metric(llm, "lmkv_errors_total", tier="connector", kind="lookup") == 1


def test_hits_of_the_engines_own_prefix_cache_are_not_counted_as_lmkvs(tiny_model_dir):
    """A repeated prompt served by the engine's prefix cache loads nothing from lmkv: it
    counts under lmkv_engine_cached_tokens, not lmkv_hit_tokens."""
    p = prompts(n=1, length=4 * CHUNK + 5, seed=11)[0]
    with lmkv_llm(tiny_model_dir, prefix_caching=True) as llm:
        llm.generate([p], GREEDY)
        assert metric(llm, "lmkv_hit_tokens_total") == 0
        out = llm.generate([p], GREEDY)[0]
        assert out.num_cached_tokens == 4 * CHUNK and out.num_external_tokens == 0
        assert metric(llm, "lmkv_hit_tokens_total") == 0
        assert metric(llm, "lmkv_loaded_tokens_total") == 0
        assert metric(llm, "lmkv_engine_cached_tokens_total") == 4 * CHUNK
        llm.engine.block_manager.reset_prefix_cache()
        out = llm.generate([p], GREEDY)[0]
        assert out.num_external_tokens == 4 * CHUNK
        assert metric(llm, "lmkv_hit_tokens_total") == 4 * CHUNK == metric(llm, "lmkv_loaded_tokens_total")


def test_a_failed_load_keeps_seeded_sampling_reproducible(tiny_model_dir):
    """The token sampled over pages a load failed to fill is thrown away and the request is
    computed again: its seeded generator is put back too, so the same seed gives the same
    tokens as without lmkv."""
    p = prompts(n=1, length=4 * CHUNK + 9, seed=12)[0]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    want = LLM(str(tiny_model_dir), enable_prefix_caching=False,
               kv_cache_memory=64 << 20).generate([p], seeded)[0].output_token_ids
    with lmkv_llm(tiny_model_dir, prefix_caching=True) as llm:
        llm.generate([p], GREEDY)  # stores p's chunks
        llm.engine.block_manager.reset_prefix_cache()
        worker = llm.engine.kv_connector.worker
        real = worker.paged.load

        failures = []

        def broken(kv, slots, skip, layer=None):
            failures.append(skip)
            raise OSError("injected load failure")

        worker.paged.load = broken
        got = llm.generate([p], seeded)[0]
        worker.paged.load = real
        assert failures  # the load was tried and failed (not skipped for a seeded request)
        assert metric(llm, "lmkv_errors_total", tier="connector", kind="load") >= 1
        assert got.num_external_tokens == 0 and got.output_token_ids == want


def test_the_engines_prefix_hits_are_counted_beside_lmkvs(tiny_model_dir):
    """A prompt served partly by the engine's prefix cache and partly by lmkv counts both."""
    p = prompts(n=1, length=4 * CHUNK + 5, seed=13)[0]
    with lmkv_llm(tiny_model_dir, prefix_caching=True) as llm:
        llm.generate([p], GREEDY)
        llm.engine.block_manager.reset_prefix_cache()
        llm.generate([p[: CHUNK + 3]], GREEDY)  # the engine holds the first chunk again
        hits = llm.engine.metrics.prefix_cache_hit_tokens._value.get()
        out = llm.generate([p], GREEDY)[0]
        assert out.num_cached_tokens > 0 and out.num_external_tokens > 0
        assert llm.engine.metrics.prefix_cache_hit_tokens._value.get() - hits == out.num_cached_tokens


def test_a_chunk_size_the_engine_cannot_use_is_refused_before_the_model_loads(tmp_path):
    from lmkv.config import load_config

    with pytest.raises(ValueError, match="chunk_size 24 must be a multiple of the engine's block size 16"):
        LLM(str(tmp_path / "no-model-here"), lmkv_config=load_config(env={}, chunk_size=24))


@pytest.mark.parametrize("layerwise", [False, True])
def test_save_unfull_chunk_stores_a_prompts_partial_last_chunk(tiny_model_dir, tmp_path, layerwise):
    """With save_unfull_chunk (LMCache's key), the same prompt again loads all but its last
    token, also when its length is not whole chunks, from the hot cache and from disk in a
    new engine; the same tokens come out; a prompt that continues it does not use the
    tail (its own next chunk differs) and still gets the same tokens. Off (the default), the
    partial chunk is computed."""
    p = prompts(n=1, length=4 * CHUNK + 9, seed=14)[0]
    longer = p + prompts(n=1, length=CHUNK, seed=15)[0]
    want = _alone(tiny_model_dir, [p, longer])
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise) as llm:
        llm.generate([p], GREEDY)
        assert llm.generate([p], GREEDY)[0].num_external_tokens == 4 * CHUNK
    disk = tmp_path / "disk"
    with lmkv_llm(tiny_model_dir, disk, use_layerwise=layerwise, save_unfull_chunk=True) as llm:
        llm.generate([p], GREEDY)
        out = llm.generate([p], GREEDY)[0]
        assert out.num_external_tokens == len(p) - 1 and out.output_token_ids == want[0]
        out = llm.generate([longer], GREEDY)[0]
        assert out.num_external_tokens == 4 * CHUNK and out.output_token_ids == want[1]
        llm.engine.kv_connector.cache.drain()
    with lmkv_llm(tiny_model_dir, disk, use_layerwise=layerwise, save_unfull_chunk=True) as llm:
        out = llm.generate([p], GREEDY)[0]  # a new engine: every chunk from disk, the tail too
        assert out.num_external_tokens == len(p) - 1 and out.output_token_ids == want[0]
        assert metric(llm, "lmkv_tier_hits_total", tier="disk") == 5


class _SlowSaves(CopyStream):
    """A save stream whose copies finish only when the host waits for them (a GPU's
    asynchronous device-to-host copies, as late as they can be)."""

    def __init__(self):
        self.waited = 0

    def mark(self):
        return object()

    def done(self, mark):
        return mark is None

    def wait(self, mark):
        self.waited += mark is not None


@pytest.mark.parametrize("layerwise", [False, True])
def test_async_saves_are_found_by_the_next_request(tiny_model_dir, reference, layerwise):
    """With a save stream that never finishes by itself, a step's chunks stay out of the
    hot cache until the engine waits for them, which it does before it looks up waiting
    requests: the prompts come back as hits, with the same tokens."""
    with lmkv_llm(tiny_model_dir, use_layerwise=layerwise) as llm:
        worker = llm.engine.kv_connector.worker
        assert worker.async_saves
        worker._saves = slow = _SlowSaves()
        first = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in first] == reference()
        again = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in again] == reference()
        assert [o.num_external_tokens for o in again] == [_full_chunks(p) for p in prompts()]
        assert slow.waited > 0
        llm.engine.kv_connector.cache.pool.check_integrity()


def test_async_saves_are_stored_when_the_engine_goes_idle(tiny_model_dir):
    """A prompt that ends in its prefill step leaves nothing pending once generate returns:
    the chunks are in the hot cache (and queued for the tiers below) for whoever asks."""
    p = prompts(n=1)[0]
    with lmkv_llm(tiny_model_dir) as llm:
        llm.engine.kv_connector.worker._saves = _SlowSaves()
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0))
        cache = llm.engine.kv_connector.cache
        assert cache.lookup(cache.keys(p)) == len(p) // CHUNK
        assert not llm.engine.kv_connector.worker._saved


def test_a_producer_stores_its_chunks_within_the_step(tiny_model_dir):
    """A producer reports a request done only once its chunks are stored (drain): its
    saves are never left for a later step, however late its copies would finish."""
    p = prompts(n=1)[0]
    with lmkv_llm(tiny_model_dir, kv_role="producer") as llm:
        worker = llm.engine.kv_connector.worker
        assert not worker.async_saves
        worker._saves = _SlowSaves()
        cache = llm.engine.kv_connector.cache
        stored = []
        drain = cache.drain

        def drained(*a, **kw):  # what a consumer could find when the request is reported done
            stored.append(cache.lookup(cache.keys(p)))
            return drain(*a, **kw)

        cache.drain = drained
        llm.generate([p], SamplingParams(max_tokens=2, temperature=0))
        assert stored == [len(p) // CHUNK]


def test_a_hot_cache_smaller_than_one_longest_prompt_is_warned_about(tiny_model_dir, caplog):
    with caplog.at_level("WARNING"), lmkv_llm(tiny_model_dir) as llm:
        cache, max_len = llm.engine.kv_connector.cache, llm.engine.max_model_len
        assert cache.pool.num_slots >= -(-max_len // CHUNK)
    assert "fewer than one max_model_len prompt" not in caplog.text
    slots = 3
    with caplog.at_level("WARNING"), lmkv_llm(
            tiny_model_dir, cpu_gb=slots * cache.layout.chunk_bytes / 1e9) as llm:
        assert llm.engine.kv_connector.cache.pool.num_slots <= slots
    assert "fewer than one max_model_len prompt" in caplog.text
    advice = float(caplog.text.split("give it at least ")[1].split(" GB")[0])
    caplog.clear()
    with caplog.at_level("WARNING"), lmkv_llm(tiny_model_dir, cpu_gb=advice):
        pass
    assert "fewer than one max_model_len prompt" not in caplog.text  # the advice is enough


@pytest.mark.parametrize("more", [0, 2 * CHUNK])
def test_a_slow_tier_read_for_a_new_request_does_not_stall_the_running_ones(
        tiny_model_dir, tmp_path, more):
    """A request arrives while another decodes, its chunks on a slow lower tier (a remote
    over a slow link): their prefetch runs while the other request's steps go on (before,
    admitting it waited on the scheduling thread for the whole read, every running request
    with it); it is admitted once they are up, loads them and gives the same tokens. With
    ``more`` tokens after the stored ones, the chunk its prefetch missed is not asked for
    again at admission (before, that read stalled the step as long)."""
    base = prompts(n=1, length=200, seed=9)[0]
    other = prompts(n=1, length=60, seed=10)[0]
    request = base + prompts(n=1, length=more, seed=11)[0]
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    want = plain.generate([request], GREEDY)[0].output_token_ids
    long = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)  # runs throughout
    with lmkv_llm(tiny_model_dir, tmp_path / "disk") as llm:
        llm.generate([base], GREEDY)
        lmkv = llm.engine.kv_connector.cache
        lmkv.drain()
        lmkv.storage.hot.clear()
        disk = lmkv.storage.tiers[0].backend
        real = disk.get_into_many

        def slow(*args, **kwargs):
            time.sleep(1.5)
            return real(*args, **kwargs)

        disk.get_into_many = slow
        engine = llm.engine
        engine.add_request("other", other, long)
        while not engine.scheduler.running:
            engine.step()
        engine.add_request("base", request, GREEDY)  # its prefetch starts now
        steps = []
        done = None
        while done is None:
            start = time.perf_counter()
            done = next((o for o in engine.step() if o.finished), None)
            steps.append(time.perf_counter() - start)
        engine.abort_request("other")
        assert done.request_id == "base" and done.output_token_ids == want
        assert done.num_external_tokens == _full_chunks(base)  # loaded, from the hot cache
        assert max(steps) < 1.0, f"a step waited {max(steps):.2f} s for the slow tier"
        assert len(steps) > 20  # other's steps went on meanwhile


def test_a_stored_chunk_holding_fewer_tokens_than_its_load_maps_is_recomputed(tiny_model_dir, reference):
    """A frame under a full chunk's key that holds fewer tokens (a foreign or buggy writer
    to a shared store; the frame reader zeroes the rest) fails its load: those tokens are
    recomputed, never attended as zeros."""
    ps = prompts()
    with lmkv_llm(tiny_model_dir, prefix_caching=True) as llm:
        llm.generate(ps, GREEDY)  # stores every full chunk
        llm.engine.block_manager.reset_prefix_cache()
        for buf in llm.engine.kv_connector.cache.storage.hot.entries.values():
            buf.num_tokens = CHUNK // 2  # as decoding such a frame leaves it
            buf.kv[:, :, CHUNK // 2 :] = 0
        outs = llm.generate(ps, GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert metric(llm, "lmkv_loaded_tokens_total") == 0
        assert metric(llm, "lmkv_errors_total", tier="connector", kind="load") >= 1
