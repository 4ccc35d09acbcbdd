"""What lmkv's scheduler role needs to know about a vLLM request, kept up to date from the
calls vLLM makes: block ids arrive through ``update_state_after_alloc`` and each step's
``SchedulerOutput``, not on the request object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestView:
    """The duck-typed request of ``lmkv.connector.SchedulerConnector`` over a vLLM ``Request``."""

    request: Any  # vllm.v1.request.Request
    block_ids: list[int] = field(default_factory=list)  # of the full-attention KV group
    num_computed_tokens: int = 0  # as lmkv must see it at the current call

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt lmkv keys chunks by; empty (nothing looked up or stored) for a request
        whose KV depends on more than its tokens, which lmkv's keys do not name: prompt
        embeddings, a LoRA adapter, multimodal inputs (their placeholder tokens are the same
        for any image), a per-request cache_salt."""
        r = self.request
        if r.prompt_token_ids is None or getattr(r, "lora_request", None) is not None:
            return []
        if getattr(r, "prompt_embeds", None) is not None:  # (ids hold placeholders for them)
            return []
        if getattr(r, "mm_features", None) or getattr(r, "cache_salt", None):
            return []
        return r.prompt_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens


class RequestViews:
    """request id -> RequestView, for the requests vLLM's scheduler currently holds."""

    def __init__(self) -> None:
        self.views: dict[str, RequestView] = {}

    def get(self, request: Any) -> RequestView:
        view = self.views.get(request.request_id)
        if view is None:
            view = self.views[request.request_id] = RequestView(request)
        return view

    def pop(self, request_id: str) -> RequestView | None:
        return self.views.pop(request_id, None)

    def scheduled(self, out: Any) -> list[tuple[RequestView, int]]:
        """(view, tokens computed this step) for each request in a vLLM ``SchedulerOutput``,
        with block ids and ``num_computed_tokens`` (before the step) brought up to date."""
        steps: list[tuple[RequestView, int]] = []
        for new in out.scheduled_new_reqs:
            view = self.views.get(new.req_id)
            if view is None:
                continue
            view.block_ids = list(new.block_ids[0])
            view.num_computed_tokens = new.num_computed_tokens
            steps.append((view, out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            view = self.views.get(rid)
            if view is None:
                continue
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # after a preemption: a fresh block list
                view.block_ids = list(blocks[0]) if blocks else []
            elif blocks:
                view.block_ids.extend(blocks[0])
            view.num_computed_tokens = cached.num_computed_tokens[i]
            steps.append((view, out.num_scheduled_tokens[rid]))
        # with async scheduling the newest sampled token may not be in all_token_ids yet
        return [(v, max(0, min(n, len(v.all_token_ids) - v.num_computed_tokens))) for v, n in steps]
