"""Chunked prefill, prefix caching, preemption and batching leave the tokens unchanged."""

from __future__ import annotations

import pytest
import torch

from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4096, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone: no chunking, no prefix cache, ample memory."""
    prompts = _prompts([3, 40, 97, 150, 260, 33])
    llm = LLM(str(tiny_model_dir), enable_prefix_caching=False, enable_chunked_prefill=False,
              kv_cache_memory=32 << 20)
    tokens = [llm.generate([p], GREEDY)[0].output_token_ids for p in prompts]
    return prompts, tokens


def _check(llm, reference, **kw):
    prompts, want = reference
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == want
    llm.engine.block_manager.check_integrity()
    return outs


def test_batching_keeps_tokens(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=32 << 20)
    _check(llm, reference)


def test_chunked_prefill_keeps_tokens(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=37, kv_cache_memory=32 << 20)
    _check(llm, reference)
    assert llm.engine.runner.num_forward_tokens > 0


def test_preemption_keeps_tokens(tiny_model_dir, reference):
    # 40 blocks of 16 tokens: the six requests (~780 prompt tokens + decodes) cannot all fit
    llm = LLM(str(tiny_model_dir), num_kv_blocks=40, max_model_len=600)
    _check(llm, reference)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_computes_only_new_tokens(tiny_model_dir, reference):
    prompts, want = reference
    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20)
    runner = llm.engine.runner
    first = llm.generate([prompts[4]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = runner.num_forward_tokens
    again = llm.generate([prompts[4]], GREEDY)[0]
    assert again.output_token_ids == want[4]
    # 260 tokens: 16 full blocks cached; the last 4 prompt tokens + 23 decodes computed
    assert again.num_cached_tokens == 256
    assert runner.num_forward_tokens - before == (260 - 256) + (GREEDY.max_tokens - 1)

    # a longer prompt sharing the first 150 tokens: only the divergent tail is computed
    extended = prompts[3] + prompts[1]
    llm.generate([prompts[3]], GREEDY)
    before = runner.num_forward_tokens
    out = llm.generate([extended], GREEDY)[0]
    assert out.num_cached_tokens == 144
    assert runner.num_forward_tokens - before == len(extended) - 144 + GREEDY.max_tokens - 1
    fresh = LLM(str(tiny_model_dir), enable_prefix_caching=False, kv_cache_memory=32 << 20)
    assert out.output_token_ids == fresh.generate([extended], GREEDY)[0].output_token_ids
    llm.engine.block_manager.check_integrity()


def test_seeded_sampling_is_reproducible_across_batching(tiny_model_dir):
    prompts = _prompts([10, 50, 80], seed=3)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=s)
              for s in (1, 2, 3)]
    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20)
    together = [o.output_token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].output_token_ids for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    greedy = llm.generate(prompts[:1], GREEDY)[0].output_token_ids[:16]
    assert together[0] != greedy  # sampling actually sampled


def test_stop_conditions(tiny_model_dir, reference):
    prompts, want = reference
    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == want[1][:5] and out.finish_reason == "length"
    stop_tok = want[1][3]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0,
                                                    stop_token_ids=(stop_tok,)))[0]
    first = want[1].index(stop_tok)
    assert out.output_token_ids == want[1][: first + 1] and out.finish_reason == "stop"
    full_text = llm.tokenizer.decode(want[1])
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full_text[: full_text.find(stop)]


def test_context_limit_finishes_with_length(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20, max_model_len=64)
    out = llm.generate(_prompts([60]), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=1e-40), dict(temperature=0.7, top_p=1e-46),
                                    dict(temperature=1e-40, top_p=1e-300, top_k=3)])
def test_extreme_but_valid_sampling_parameters_sample_the_likeliest_token(kwargs):
    """A temperature or top_p so small that float32 cannot tell it from 0 leaves the likeliest
    token (its limit), never NaN probabilities: torch.multinomial raised on those and failed
    the step of every request batched with it."""
    from lmkv_engines.minimal.sampler import sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 20
    params = [SamplingParams(**kwargs)] * 3
    assert sample(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def test_bad_requests_are_clear_errors(tiny_model_dir, tmp_path):
    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(5, 100))])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 10**9]])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))


def test_a_failed_step_leaves_no_partial_kv_in_the_prefix_cache(tiny_model_dir, reference):
    """A forward pass that raises half way (at layer 1 of 2: an out of memory, say): the
    prompt asked again is computed again, not served from the pages that step left half
    written, and the same tokens come out; the failed generate leaves no request behind."""
    prompts, want = reference
    from .lmkv_workload import fail_once_at_layer

    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20)
    fail_once_at_layer(llm, 1)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([prompts[3]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([prompts[3]], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.output_token_ids == want[3]
    llm.engine.block_manager.check_integrity()


def test_without_chunked_prefill_the_step_budget_must_hold_the_context(tiny_model_dir):
    """Otherwise a longer prompt (or a preempted request's recompute) is never scheduled
    and every request behind it waits for ever."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be at least max_model_len"):
        LLM(str(tiny_model_dir), kv_cache_memory=32 << 20, enable_chunked_prefill=False,
            max_num_batched_tokens=64, max_model_len=256)


def test_a_stop_string_ending_in_a_character_split_over_tokens(tiny_model_dir, monkeypatch):
    """東 is three tokens of the demo tokenizer: the first two decode to U+FFFD and the third
    completes it without lengthening the text; a stop string ending in it still stops."""
    import lmkv_engines.minimal.model_runner as model_runner

    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20)
    tok = llm.tokenizer
    script = tok.encode("ab東cd", False) + tok.encode(" more text here", False) * 3
    assert len(tok.encode("東", False)) > 1
    at = {"i": 0}

    def scripted(logits, params, generators):
        out = [script[(at["i"] + k) % len(script)] for k in range(len(params))]
        at["i"] += len(params)
        return out

    monkeypatch.setattr(model_runner, "sample", scripted)
    for stop, text in (("東", "ab"), ("b東", "a"), ("東c", "ab")):
        at["i"] = 0
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
        assert (out.finish_reason, out.text) == ("stop", text), stop


def test_a_decode_step_touches_only_what_is_new(tiny_model_dir, monkeypatch):
    """A decode step's host work does not grow with the sequences (on a GPU it runs between
    the device's steps): no request's whole token list is rebuilt, only blocks completed in
    the step are hashed and offered to the prefix cache, block tables are not converted
    again, and delta outputs hold only the new token."""
    from lmkv_engines.minimal import block_manager as bm_module
    from lmkv_engines.minimal.request import Request
    from lmkv_engines.minimal.sampling_params import OutputKind

    class Counting(list):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return super().__getitem__(i)

    llm = LLM(str(tiny_model_dir), kv_cache_memory=64 << 20)
    engine = llm.engine
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True,
                            output_kind=OutputKind.DELTA)
    for i, prompt in enumerate(_prompts([1500, 1700, 2000], seed=7)):
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    hashed, tokens_read, conversions = [], [], []
    hash_block, token_ids, tensor = bm_module.hash_block, Request.token_ids, torch.tensor
    monkeypatch.setattr(bm_module, "hash_block", lambda *a: hashed.append(1) or hash_block(*a))
    monkeypatch.setattr(Request, "token_ids",
                        lambda self, a, b: tokens_read.append(b - a) or token_ids(self, a, b))
    monkeypatch.setattr(Request, "all_token_ids", property(lambda self: pytest.fail("rebuilt")))
    engine.block_manager.blocks = Counting(engine.block_manager.blocks)
    monkeypatch.setattr(torch, "tensor", lambda data, *a, **k: conversions.append(
        len(data) if isinstance(data, list) else 1) or tensor(data, *a, **k))
    steps = 48  # 3 blocks of 16 per request
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == 3 and all(len(o.output_token_ids) == 1 for o in outs)
    assert len(hashed) <= 3 * (steps // 16 + 1)
    assert Counting.reads <= 2 * 3 * (steps // 16 + 1)  # a new block: taken, then registered
    assert sum(tokens_read) <= 2 * 3 * steps  # the new token (and its hash block's 16 / 16)
    assert max(conversions) <= 16, "a list as long as a sequence was converted to a tensor"
    for request_id in list(engine.requests):
        engine.abort_request(request_id)


def test_a_prefix_stays_cached_while_any_copy_of_it_is():
    """Two requests that computed the same blocks each register their copy: when one copy
    is evicted (its request finished, other traffic took its pages), the prefix is still
    found through the other, held by a request still running."""
    from lmkv_engines.minimal.block_manager import BlockManager
    from lmkv_engines.minimal.request import Request

    bm = BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(100, 108))  # two full blocks; the second can never be a hit
    a, b = (Request(name, list(prompt), SamplingParams()) for name in "ab")
    for r in (a, b):  # b hits a's first block only: it computes its own second block
        hit = bm.get_computed_blocks(r)
        assert bm.allocate_slots(r, r.num_tokens - hit.num_tokens, hit)
        r.num_computed_tokens = r.num_tokens
    bm.free(a)
    other = Request("other", list(range(900, 916)), SamplingParams(), cacheable=False)
    assert bm.allocate_slots(other, 16)  # evicts a's second block
    bm.free(other)
    for t in range(3):  # b decodes on
        b.output_token_ids.append(t + 1)
        assert bm.allocate_slots(b, 1)
        b.num_computed_tokens += 1
    bm.check_integrity()
    later = Request("later", [*prompt, 7, 7, 7, 7], SamplingParams())
    assert bm.get_computed_blocks(later).num_tokens == 8


def test_a_prefix_hit_takes_the_copy_a_request_holds():
    """Of two copies of a cached block, a hit takes the one a running request holds: the
    other sits in the free queue, and taking it would cost a free block that admission may
    not have."""
    from lmkv_engines.minimal.block_manager import BlockManager
    from lmkv_engines.minimal.request import Request

    bm = BlockManager(num_blocks=3, block_size=4)
    a = Request("a", [1, 2, 3, 4, 9], SamplingParams())
    assert bm.allocate_slots(a, a.num_tokens, bm.get_computed_blocks(a))
    bm.free(a)  # its first block stays cached, in the free queue
    b = Request("b", [1, 2, 3, 4], SamplingParams())  # no hit (never the last token): a copy
    assert bm.allocate_slots(b, b.num_tokens, bm.get_computed_blocks(b))
    b.num_computed_tokens = b.num_tokens
    b.output_token_ids.append(7)
    assert bm.allocate_slots(b, 1)  # one block left free
    c = Request("c", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    hit = bm.get_computed_blocks(c)
    assert hit.blocks[0].block_id == b.block_ids[0]
    assert bm.allocate_slots(c, c.num_tokens - hit.num_tokens, hit)
    bm.check_integrity()


def test_the_gauges_show_the_requests_of_a_step_while_it_runs(tiny_model_dir):
    """engine_requests_running/waiting are scraped while a step runs (a prefill or a load
    may take seconds): they must show the queued requests, and the batch being computed,
    not what the step before (an idle engine: 0) left."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20)
    engine = llm.engine
    gauges = engine.metrics

    def read():
        return gauges.running._value.get(), gauges.waiting._value.get()

    for i, prompt in enumerate(_prompts([40, 97, 150])):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2, temperature=0))
    assert read() == (0, 3)  # queued, before any step
    seen = []
    execute = engine.runner.execute
    engine.runner.execute = lambda *a, **k: (seen.append(read()), execute(*a, **k))[1]
    engine.step()
    assert seen == [(3, 0)]  # the prefill of all three, as it ran


def test_a_prompt_of_bad_token_ids_is_refused_and_nothing_is_queued(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), kv_cache_memory=32 << 20).engine
    vocab = engine.model_config.vocab_size
    for i, bad in enumerate(([1, -1], [1, vocab], [1, 2.0], ["a"], [1, 2**70], [None])):
        with pytest.raises(ValueError, match=rf"prompt token ids must be integers in \[0, {vocab}\)"):
            engine.add_request(f"bad{i}", bad)
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert engine.add_request("ok", [0, 2, vocab - 1]).prompt_token_ids == [0, 2, vocab - 1]
