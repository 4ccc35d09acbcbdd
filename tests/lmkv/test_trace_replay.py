"""lmkv's hot cache on a real request trace (the Mooncake conversation trace in shared/):
it serves exactly what a textbook LRU cache of the same size would, at several sizes."""

from __future__ import annotations

import pytest

from benchmarks.trace_replay import DEFAULT_TRACE, load_trace, plain_lru, replay

pytestmark = pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"no trace at {DEFAULT_TRACE}")


@pytest.mark.parametrize("capacity", [50, 400, 3000])
def test_hot_cache_serves_what_lru_serves_on_a_real_trace(capacity):
    trace = load_trace(DEFAULT_TRACE, 1500)
    served, _ = replay(trace, capacity)
    assert served == plain_lru(trace, capacity)
    assert 0 < served < plain_lru(trace, None)
