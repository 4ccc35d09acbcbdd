"""lmkv's hot cache on request traces (the Mooncake conversation trace in shared/, where the
checkout has it beside it, and the generated ones, always): with cache_policy lru it serves
exactly what a textbook LRU cache of the same size would; with each policy it serves what
that policy, driven directly, serves (the benchmark's sweeps drive policies directly); the
default never serves less than LRU; Belady is an upper bound on block hits, also of a policy
that stores only blocks used again."""

from __future__ import annotations

import pytest

from benchmarks.trace_replay import (
    DEFAULT_TRACE,
    belady,
    load_trace,
    next_uses,
    plain_lru,
    replay,
    simulate,
    synthetic_trace,
)
from lmkv.policy import DEFAULT_POLICY

needs_trace = pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"no trace at {DEFAULT_TRACE}")
TRACES = [pytest.param("conversation", marks=needs_trace), "agent", "rag"]


def trace_of(name: str, requests: int = 1500):
    return load_trace(DEFAULT_TRACE, requests) if name == "conversation" else synthetic_trace(name, requests)


@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("capacity", [50, 400, 1000, 3000])
def test_hot_cache_with_lru_serves_what_lru_serves(name, capacity):
    if (name, capacity) == ("agent", 3000):
        pytest.skip("1500 agent requests' reuse fits in 3000 chunks: nothing to evict")
    trace = trace_of(name)
    served, _, _ = replay(trace, capacity, "lru")
    assert served == plain_lru(trace, capacity) == simulate(trace, capacity, "lru")
    assert 0 < served < plain_lru(trace, None)  # the cache is too small to hold all reuse


@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("capacity", [50, 400, 3000])
def test_hot_cache_with_the_default_serves_what_the_policy_serves_and_no_less_than_lru(name, capacity):
    trace = trace_of(name)
    served, _, _ = replay(trace, capacity, DEFAULT_POLICY)
    assert served == simulate(trace, capacity, DEFAULT_POLICY)
    assert plain_lru(trace, capacity) <= served <= plain_lru(trace, None)


def test_belady_bounds_the_policies_on_a_generated_trace():
    trace = synthetic_trace("agent", 800)
    opt = belady(trace, 200)
    assert opt <= plain_lru(trace, None)
    assert all(simulate(trace, 200, p) <= opt for p in ("lru", "prefix_lru", DEFAULT_POLICY))


@pytest.mark.parametrize("name", [TRACES[0], "rag"])
def test_the_admission_oracle_stores_only_blocks_used_again_and_lru_gains_by_it(name):
    trace = trace_of(name)
    blocks = [k for _, keys in trace for k in keys]
    uses = next_uses(trace)
    later = {k: i for i, k in enumerate(blocks)}  # the last use of each key
    assert all((uses[i] < len(blocks)) == (later[k] > i) for i, k in enumerate(blocks))
    keep = [n < len(blocks) for n in uses]
    for p in ("lru", DEFAULT_POLICY):
        assert simulate(trace, 400, p) < simulate(trace, 400, p, keep) <= belady(trace, 400)
