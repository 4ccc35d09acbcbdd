"""The engine scheduler's admissions with lmkv: a request whose chunks are still coming up
from a lower tier waits in the queue while other requests run."""

from __future__ import annotations

import logging

from lmkv_engines.minimal.block_manager import BlockManager
from lmkv_engines.minimal.request import Request
from lmkv_engines.minimal.sampling_params import SamplingParams
from lmkv_engines.minimal.scheduler import Scheduler, SchedulerConfig


def test_a_request_whose_chunks_are_still_coming_up_waits_while_others_run(monkeypatch):
    """A request whose chunks are still on their way up from a lower tier (its prefetch at
    arrival, over a slow link) is left waiting while other requests run: looking it up would
    stall their steps for the whole read. With nothing else to run it is looked up (and
    waits) as before."""
    class Connector:
        arriving = True
        lookups: list[str] = []

        def on_new_request(self, req, hit):
            pass

        def prefix_cache_salt(self, req):
            return b""

        def get_blend_plan(self, req, num_computed):
            return None

        def loads_arriving(self, req, num_computed):
            return self.arriving

        def get_num_new_matched_tokens(self, req, num_computed):
            self.lookups.append(req.request_id)
            return 0, False

        def update_state_after_alloc(self, req, block_ids, external):
            pass

    connector = Connector()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                                      max_model_len=4096), BlockManager(64, 16), connector)
    first = Request("first", list(range(5, 37)), SamplingParams())
    sched.add(first)
    assert [s.request for s in sched.schedule().scheduled] == [first]  # nothing else: looked up
    second = Request("second", list(range(50, 82)), SamplingParams())
    sched.add(second)
    for _ in range(3):  # first decodes; second waits for its chunks without stalling it
        first.num_computed_tokens = first.num_tokens
        first.output_token_ids.append(7)
        assert [(s.request, s.num_new_tokens) for s in sched.schedule().scheduled] == [(first, 1)]
        assert connector.lookups == ["first"]
    connector.arriving = False  # they are up: admitted
    assert [s.request for s in sched.schedule().scheduled] == [first, second]
    assert connector.lookups == ["first", "second"]


def test_a_lookup_that_keeps_failing_is_not_a_traceback_per_request(caplog):
    """From a review: every request whose lmkv lookup raised logged a traceback (and again
    at every step it waited for blocks): a fault that lasts is told once a minute."""
    from types import SimpleNamespace

    from lmkv.logs import LogThrottle
    from lmkv_engines.minimal.scheduler import _matched

    class Broken:
        cache = SimpleNamespace(count_error=lambda where, kind: None)

        def get_num_new_matched_tokens(self, req, computed):
            raise RuntimeError("a decoder bug")

    quiet = LogThrottle()  # (the scheduler's own)
    with caplog.at_level(logging.ERROR):
        for i in range(100):
            assert _matched(Broken(), SimpleNamespace(request_id=f"r{i}"), 0, quiet) == 0
    lines = [r for r in caplog.records if "lookup for request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is not None
