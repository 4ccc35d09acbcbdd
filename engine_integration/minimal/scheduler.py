"""Continuous batching: which requests run this step, and how many tokens each.

Each step has a token budget. Running requests go first (one token for a decode, the
next slice of the prompt for a chunked prefill), then waiting requests are admitted in
arrival order (one whose lmkv chunks are still coming up from a lower tier waits while
other requests run: its lookup would stall them). When the block pool runs dry, the most
recently admitted running request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed later (its prefix-cached blocks usually survive,
so that is cheap).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmkv.logs import LogThrottle

from .block_manager import BlockManager, ComputedBlocks
from .request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from lmkv.connector import SchedulerConnector

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + this) run now


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 connector: SchedulerConnector | None = None):
        self.config = config
        self.blocks = blocks
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # lmkv's failures in a step, told with their traceback once a minute per kind: a
        # fault that lasts (a decoder's bug re-raised for every chunk) fails every lookup
        self._quiet = LogThrottle()

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if self.connector is not None and request.use_cache:
            # the salt before its blocks are first hashed; no prefetch of what the engine holds
            request.prefix_cache_salt = self.connector.prefix_cache_salt(request)
            hit = self.blocks.get_computed_blocks(request).num_tokens
            self.connector.on_new_request(request, hit)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget and not chunked:
                i += 1
                continue
            num_new = min(num_new, budget)
            while not self.blocks.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            blend = None
            connector = self.connector if req.use_cache else None
            computed = (self.blocks.get_computed_blocks(req) if req.use_cache
                        else ComputedBlocks([], 0))
            if (connector is not None and out.scheduled
                    and _arriving(connector, req, computed.num_tokens, self._quiet)):
                break  # looked up now it would stall the running requests: next step
            if connector is not None and not req.output_token_ids:
                # (none where the engine's hit leaves less to compute than a blend would)
                blend = _blend_plan(connector, req, computed.num_tokens, self._quiet)
            if blend is not None:
                # a blended prefill runs the whole prompt in one step, whatever the budget;
                # its pages go to the prefix cache under the prompt's blend salt
                computed, external, num_new = ComputedBlocks([], 0), 0, req.num_tokens
            else:
                external = 0  # tokens after the local hit that lmkv loads
                if connector is not None:
                    external = _matched(connector, req, computed.num_tokens, self._quiet)
                num_new = req.num_tokens - computed.num_tokens - external
                if num_new > budget and not chunked:
                    break
                num_new = min(num_new, budget)
            if not self.blocks.allocate_slots(req, external + num_new, computed):
                break
            req.blend = blend
            req.num_computed_tokens = computed.num_tokens
            if self.connector is not None and not _allocated(self.connector, req, external, self._quiet):
                # not admitted: the pages past its hit hold nothing (their hashes go), and
                # it waits for the next step, where lmkv loads nothing for it
                self.blocks.forget(req.block_ids[len(computed.blocks):])
                self.blocks.free(req)
                _drop_blend(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens += external
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed.num_tokens
                req.num_external_tokens = blend.num_cached_tokens if blend else external
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        _drop_blend(request)
        self.blocks.free(request)
        if self.connector is not None:
            self.connector.request_finished(request)

    def requeue(self, request: Request) -> None:
        """Put a running request back at the front of the queue, to be computed again from
        its first token (its pages held KV that cannot be trusted)."""
        self.running.remove(request)
        _drop_blend(request)
        self.blocks.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        _drop_blend(request)
        self.blocks.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def _drop_blend(req: Request) -> None:
    """Give back the stored chunks of a blended prefill that will not run (or not finish)."""
    if req.blend is not None:
        req.blend.release()
        req.blend = None


def _blend_plan(connector, req, num_computed: int, quiet: LogThrottle):
    """The request's blend plan, or None (it takes the prefix path) if there is none or
    finding it raises: one request's lookup never fails the step."""
    try:
        return connector.get_blend_plan(req, num_computed)
    except Exception:
        quiet.log(log, logging.ERROR, "blend", "lmkv: RAG chunk lookup for request %s failed; "
                  "computing it", req.request_id, exc_info=True)
        connector.cache.count_error("connector", "blend")
        return None


def _arriving(connector, req, num_computed: int, quiet: LogThrottle) -> bool:
    """Whether to leave ``req`` waiting this step: the chunks lmkv would load for it are
    still coming up from a lower tier (a slow remote takes seconds; lmkv says so for
    ARRIVING_WAIT seconds at most). False if asking raises."""
    try:
        return connector.loads_arriving(req, num_computed)
    except Exception:
        quiet.log(log, logging.ERROR, "arriving", "lmkv: asking whether request %s's chunks "
                  "are on their way failed; looking it up now", req.request_id, exc_info=True)
        return False


def _allocated(connector, req, external: int, quiet: LogThrottle) -> bool:
    """Tell lmkv the engine took its offer for ``req`` (``external`` tokens loaded); False
    if that raises: lmkv then loads nothing for the request (logged, counted), which is
    admitted again without it. One request's failure never fails the step, nor leaves
    pages registered in the prefix cache that nothing computes."""
    try:
        connector.update_state_after_alloc(req, req.block_ids, external)
        return True
    except Exception:
        quiet.log(log, logging.ERROR, "allocated", "lmkv: taking the load planned for request "
                  "%s failed; computing it", req.request_id, exc_info=True)
        connector.cache.count_error("connector", "load")
        try:
            connector.recompute_without_loads(req)
        except Exception:
            quiet.log(log, logging.ERROR, "drop", "lmkv: request %s: dropping its lmkv state "
                      "failed", req.request_id, exc_info=True)
        return False


def _matched(connector, req, num_computed: int, quiet: LogThrottle) -> int:
    """Tokens lmkv will load for ``req`` after its local hit; 0 (it is computed) if the
    lookup raises: one request's lookup never fails the step."""
    try:
        return connector.get_num_new_matched_tokens(req, num_computed)[0]
    except Exception:
        quiet.log(log, logging.ERROR, "lookup", "lmkv: lookup for request %s failed; computing "
                  "it", req.request_id, exc_info=True)
        connector.cache.count_error("connector", "lookup")
        return 0
