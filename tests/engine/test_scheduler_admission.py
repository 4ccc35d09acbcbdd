"""The engine scheduler's admissions with lmkv: a request whose chunks are still coming up
from a lower tier waits in the queue while other requests run."""

from __future__ import annotations

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
