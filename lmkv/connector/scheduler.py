"""The scheduler role: how many tokens lmkv can supply, and what to load and save each step.

It speaks keys only, through ``ChunkIndex``: the LMKVCache itself where the worker role
shares its process, a client of the worker's process otherwise (vLLM's ``vllm serve``).
Requests are duck-typed: ``request_id``, ``prompt_token_ids``, ``all_token_ids``,
``num_tokens`` (its length, asked every step), ``block_ids`` and ``num_computed_tokens``,
as the bundled engine's and vLLM's have them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..blend.plan import BlendPlan
from ..blend.segments import split_segments
from ..config import LMKVConfig
from .metadata import ConnectorMetadata, LoadSpec, SaveSpec

log = logging.getLogger(__name__)

# seconds a request is said to have chunks arriving (loads_arriving): an engine may leave it
# waiting that long at most, then looks it up (and waits for them) all the same
ARRIVING_WAIT = 10.0


class Arrival(Protocol):
    """Chunks being read up to the hot cache for a waiting request (bring_up), held there
    until released."""

    def done(self) -> bool: ...
    def release(self) -> None: ...


class _AllArrived:
    """Several runs of chunks being read up for one request (a RAG prompt's documents)."""

    def __init__(self, arrivals: list[Arrival]):
        self.arrivals = arrivals

    def done(self) -> bool:
        return all(a.done() for a in self.arrivals)

    def release(self) -> None:
        for a in self.arrivals:
            a.release()


class ChunkIndex(Protocol):
    """What the scheduler role asks of lmkv's cache object that holds the chunks (LMKVCache).
    With enable_blending it also needs ``blend_plan``, which only a cache object in the same
    process has (a plan holds chunk buffers)."""

    config: LMKVConfig
    chunk_size: int

    def keys(self, tokens: list[int]) -> list[str]: ...
    def tail_key(self, tokens: list[int]) -> str | None: ...
    def lookup(self, keys: list[str]) -> int: ...
    def touch(self, keys: list[str]) -> None: ...
    def pin(self, keys: list[str], parent: str | None = None, again: bool = False) -> list[bool]: ...
    def unpin(self, keys: list[str]) -> None: ...
    def prefetch(self, keys: list[str], parent: str | None = None) -> None: ...
    def bring_up(self, keys: list[str], parent: str | None = None) -> Arrival | None: ...
    def segment_keys(self, tokens: list[int], separator: list[int]) -> list[list[str]]: ...
    def record_lookup(self, prompt_tokens: int, hit_tokens: int, engine_tokens: int = 0) -> None: ...
    def record_blend(self, prompt_tokens: int, hit_tokens: int) -> None: ...
    def drain(self) -> None: ...
    # (SchedulerConnector.reset only, which vLLM's connector calls: its LookupClient has it)
    def new_epoch(self) -> None: ...


@dataclass(slots=True)
class _RequestState:
    keys: list[str]  # keys of the request's full chunks known so far
    # save_unfull_chunk: the key of the prompt's partial last chunk, and whether it is stored
    # (or was loaded) for this request
    tail: str | None = None
    tail_done: bool = False
    tail_of: int = 0  # the prompt length ``tail`` was made for (a session's prompt grows)
    pinned: list[str] = field(default_factory=list)  # keys pinned for a load, not yet planned
    pinned_from: int = 0  # chunk index of pinned[0]
    load_from: int = 0  # tokens [load_from, load_to) come from lmkv this step
    load_to: int = 0
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or being stored
    # chunks under the engine's own hit that lmkv lacks while it holds later ones: saved at
    # the next step, apart from the chunks being loaded (never saved back)
    gap: range = range(0)
    plan: BlendPlan | None = None  # found by get_blend_plan, until the engine takes it
    blended: bool = False  # its KV is approximate: never saved as prefix chunks
    lossy: bool = False  # some loaded chunk was decoded from a lossy codec
    # a lookup not counted yet: (prompt tokens, the engine's own hit); counted once, when the
    # engine allocates (a request that waits for blocks is looked up again every step)
    looked_up: tuple[int, int] | None = None
    # what the last lookup found stored (chunks, and whether the partial last chunk): not
    # saved again by this request once the engine allocates it (until then they may leave)
    found: tuple[int, bool] = (0, False)
    documents: list[list[str]] | None = None  # with blending: its documents' keys (_document_keys)
    no_loads: bool = False  # a load into its pages failed: it is recomputed without lmkv
    no_saves: bool = False  # known before the cache was reset (reset): it may hold old KV
    touched: bool = False  # its engine prefix hit was counted as a use (once per request)
    salted: bool = False  # the engine files its blocks under prefix_cache_salt's blend namespace
    # its chunks being read up from a lower tier, ahead of queued work, before it is looked
    # up (loads_arriving; None: nothing to bring up, or let go at its lookup); done: they are
    # up (and held there until let go), or failed. Since when (time.monotonic(); None: not
    # asked yet)
    bringing: Arrival | None = None
    bringing_since: float | None = None


# Keys of chunks loaded lossy that the engine's prefix cache may still hold: a later request
# whose engine hit covers one of them computes over lossy KV as well. Bounded; at 16 tokens
# a chunk it covers a million tokens of engine memory.
LOSSY_KEYS_KEPT = 1 << 16


def _remember(table: OrderedDict[str, Any], key: str, default: Any) -> Any:
    """``table[key]`` (set to ``default`` if absent), now the newest; the oldest entry goes
    past LOSSY_KEYS_KEPT."""
    value = table.setdefault(key, default)
    table.move_to_end(key)
    if len(table) > LOSSY_KEYS_KEPT:
        table.popitem(last=False)
    return value


class SchedulerConnector:
    def __init__(self, cache: ChunkIndex, block_size: int, blend_separator: list[int] | None = None):
        if cache.chunk_size % block_size:
            raise ValueError(
                f"lmkv chunk_size {cache.chunk_size} must be a multiple of the engine's "
                f"block size {block_size}"
            )
        self.cache = cache
        self.block_size = block_size
        self.save_decode_cache = cache.config.save_decode_cache
        self.save_tail = cache.config.save_unfull_chunk
        # prefill/decode disaggregation: a producer only saves, a consumer only loads
        self.loads = cache.config.kv_role != "producer"
        self.saves = cache.config.kv_role != "consumer"
        # (a producer reads nothing stored, RAG chunks included)
        self.blending = cache.config.enable_blending and self.loads
        if self.blending and not blend_separator:
            raise ValueError("enable_blending needs the token ids of blend_special_str")
        self.blend_separator = blend_separator or []
        self.states: dict[str, _RequestState] = {}
        self.lossy_keys: OrderedDict[str, None] = OrderedDict()
        # partial last chunks loaded lossy: the chunk before each ("" for none) -> lengths
        self.lossy_tails: OrderedDict[str, set[int]] = OrderedDict()
        # requests holding pins that build_connector_meta has not planned yet
        self.pinning: set[str] = set()

    def on_new_request(self, request: Any, num_computed_tokens: int = 0) -> None:
        """A request entered the engine's queue: start pulling its chunks up to the hot cache,
        past ``num_computed_tokens`` (the engine's own prefix hit as it stands now, where
        the engine knows it: lmkv never loads the chunks under that hit). A producer loads
        nothing, so reads nothing up."""
        if not self.loads:
            return
        st = self._state(request)
        first = num_computed_tokens // self.cache.chunk_size
        if first < len(st.keys):
            self.cache.prefetch(st.keys[first:], st.keys[first - 1] if first else None)
        for keys in self._document_keys(request):  # a RAG prompt's documents, each a run
            self.cache.prefetch(keys)

    def loads_arriving(self, request: Any, num_computed_tokens: int = 0) -> bool:
        """Whether chunks the request would load past ``num_computed_tokens`` (the engine's
        own hit) are still coming up from a lower tier: looking it up now would wait for
        them, and the engine's scheduling with it, so an engine with other work may admit
        it later instead. Where a prefetch (its own at arrival, or another request's) holds
        them, they are read up now in a job ahead of queued saves and prefetches,
        and are arriving until it is done, ARRIVING_WAIT seconds at most (asked once per
        request: a request looked up once is never held back after)."""
        st = self._state(request)
        if not self.loads or st.no_loads:  # it will load nothing
            return False
        if st.bringing_since is None:
            st.bringing_since = time.monotonic()  # (asked once, even if this raises)
            first = num_computed_tokens // self.cache.chunk_size
            runs = [(st.keys[first:], st.keys[first - 1] if first else None)]
            runs += [(keys, None) for keys in self._document_keys(request)]
            arrivals: list[Arrival] = []
            try:
                for keys, parent in runs:
                    if keys and (arrival := self.cache.bring_up(keys, parent)) is not None:
                        arrivals.append(arrival)
            except BaseException:  # the runs started hold their chunks: let them go
                for arrival in arrivals:
                    arrival.release()
                raise
            st.bringing = (None if not arrivals else arrivals[0] if len(arrivals) == 1
                           else _AllArrived(arrivals))
        return (st.bringing is not None and time.monotonic() - st.bringing_since < ARRIVING_WAIT
                and not st.bringing.done())

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (the engine's own prefix cache hit) that lmkv
        will load. The chunks are fetched into the hot cache and pinned there now, so the
        load cannot miss them. Loads are synchronous.

        The hit never covers the last prompt token (it is computed: it yields the first
        logits), but it may end inside a chunk: when the prompt's last chunk is full and
        stored, all of it but that token is loaded, so a repeated prompt computes one
        token, not a chunk."""
        st = self._state(request)
        self._unpin(st)
        again = st.looked_up is not None  # waiting for memory: its hits were counted
        st.found = (0, False)  # (none kept from an earlier lookup, if this one fails)
        if st.salted and num_computed_tokens:
            # the engine's hit may hold blended KV: what is computed over it is not exact
            st.blended = True
        c = self.cache.chunk_size
        full = min(len(st.keys), len(request.prompt_token_ids) // c)
        if self.lossy_keys and not st.lossy:  # the engine's hit holds KV another request loaded lossy
            st.lossy = (self._engine_hit_lossy(st.keys[: min(-(-num_computed_tokens // c), full)])
                        or self._engine_hit_lossy_tail(request.prompt_token_ids, st.keys,
                                                       num_computed_tokens))
        if not self.loads or st.no_loads:
            return 0, False
        # Chunks wholly below num_computed_tokens are in the engine's own prefix cache: only
        # ask whether lmkv has them (for the hit metric and to skip re-saving them); fetch
        # from the first chunk the engine lacks.
        first = min(num_computed_tokens // c, full)
        below = self.cache.lookup(st.keys[:first]) if first else 0
        if below and not st.touched:  # used now, as if loaded: the chunks saved after them
            self.cache.touch(st.keys[:below])  # are kept behind them
            st.touched = True
        # pins taken from here on are given back at the step's plan unless the engine
        # allocates the request
        self.pinning.add(request.request_id)
        # each pin names the chunk before its first (the prefix policies keep a chunk only
        # behind its parent, and the engine's own hit may hold that parent)
        lossy = (self.cache.pin(st.keys[first:full], st.keys[first - 1] if first else None, again)
                 if full > first else [])
        # at once: whatever follows, these pins are given back or loaded
        st.pinned, st.pinned_from = st.keys[first : first + len(lossy)], first
        self._note_lossy([k for k, flag in zip(st.keys[first:], lossy, strict=False) if flag])
        for i, flag in enumerate(lossy, start=first):  # an engine hit may reach into part of
            if flag:  # such a chunk (blocks are finer than chunks): note its first block too
                prompt = request.prompt_token_ids
                end = i * c + self.block_size
                if end < c * (i + 1) and end <= len(prompt):
                    self._note_lossy([self.cache.tail_key(prompt[:end])])
                    self._note_lossy_tail(st.keys[i - 1] if i else "", self.block_size)
        self._let_go(st)  # pinned (or missed) now: what was held for the lookup goes
        found = first + len(lossy) if lossy else below
        st.gap = range(below, first) if lossy else range(0)
        tail: list[bool] = []
        self._fresh_tail(st, request)
        if (st.tail is not None and first + len(lossy) == full
                and len(request.prompt_token_ids) - full * c > 1):  # a tail of 1: nothing to load
            # the same prompt again: its partial last chunk
            tail = self.cache.pin([st.tail], st.keys[full - 1] if full else None, again)
            if tail:
                st.pinned.append(st.tail)
                lossy = lossy + tail
                if tail[0]:
                    self._note_lossy([st.tail])
                    self._note_lossy_tail(st.keys[full - 1] if full else "",
                                          len(request.prompt_token_ids) - full * c)
        st.found = (found, bool(tail))
        st.lossy = st.lossy or any(lossy)
        hit = min((first + len(lossy)) * c, len(request.prompt_token_ids) - 1)
        st.looked_up = (len(request.prompt_token_ids), num_computed_tokens)
        if hit <= num_computed_tokens:
            self._unpin(st)
            return 0, False
        holding = -(-hit // c) - first  # chunks that hold loaded tokens (chunk_size 1: one less)
        self.cache.unpin(st.pinned[holding:])
        del st.pinned[holding:]
        return hit - num_computed_tokens, False

    def prefix_cache_salt(self, request: Any) -> bytes:
        """What the engine mixes into the prefix-cache hashes of ``request``'s blocks: for a
        prompt that blending may serve (blending on, more than one segment), a namespace of
        its own, so that blended (approximate) KV is found again only by prompts that would
        be blended too, never by an exact request; b"" otherwise. An engine that salts its
        blocks so asks before its first lookup of the request."""
        if not self.blending:
            return b""
        prompt = request.prompt_token_ids
        if len(split_segments(prompt, self.blend_separator)) < 2:
            return b""
        self._state(request).salted = True
        cfg = self.cache.config
        return (f"lmkv-blend:{cfg.blend_recompute_ratio}:{cfg.blend_check_layer}:"
                f"{int(cfg.blend_store_pre_rope)}").encode()

    def get_blend_plan(self, request: Any, num_computed_tokens: int = 0) -> BlendPlan | None:
        """With blending on: the stored RAG chunks among the prompt's segments, fetched and
        pinned, or None (then the request takes the prefix path). The engine owns the plan
        once update_state_after_alloc is called; until then lmkv keeps it.

        ``num_computed_tokens``: the engine's own prefix hit (in a salted namespace, see
        prefix_cache_salt: the KV of an earlier blended or computed prompt with these tokens). When
        computing the rest of the prompt after that hit costs no more tokens than a blend
        would recompute, there is no plan: a RAG prompt sent again (or continued, as a chat's
        next turn) reuses the engine's pages instead of blending again."""
        if not self.blending:
            return None
        st = self._state(request)
        self._drop_plan(st)
        if st.no_loads:  # (a load for it failed: computed without lmkv)
            return None
        prompt = request.prompt_token_ids
        ratio = self.cache.config.blend_recompute_ratio

        def hit_costs_less(cached: int) -> bool:  # than a blend reusing ``cached`` tokens
            rest = len(prompt) - num_computed_tokens  # what the prefix path computes
            return bool(num_computed_tokens) and rest <= len(prompt) - cached + ratio * cached

        plan = None  # (checked first against every segment but the query stored: no fetch)
        if not (num_computed_tokens and hit_costs_less(
                len(prompt) - split_segments(prompt, self.blend_separator)[-1].length)):
            plan = self.cache.blend_plan(prompt, self.blend_separator)
            if plan is not None and hit_costs_less(plan.num_cached_tokens):
                plan.release()
                plan = None
        st.plan = plan
        st.blended = plan is not None
        if plan is not None:
            self._let_go(st)  # the plan holds its chunks now
        return plan

    def _document_keys(self, request: Any) -> list[list[str]]:
        """With blending, the content keys of the documents of a prompt that has them (a
        blend reads them, not its prefix chunks), one run each; else none."""
        st = self._state(request)
        if st.documents is None:  # (asked at arrival and again when it may be admitted)
            prompt = request.prompt_token_ids
            st.documents = ([] if not self.blending or len(split_segments(prompt, self.blend_separator)) < 2
                            else self.cache.segment_keys(prompt, self.blend_separator))
        return st.documents

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        found, tail = st.found  # stored when it was looked up: not saved again
        st.saved_chunks, st.tail_done = max(st.saved_chunks, found), st.tail_done or tail
        st.found = (0, False)
        if st.plan is not None:
            self.cache.record_blend(len(request.prompt_token_ids), st.plan.num_cached_tokens)
        elif st.looked_up is not None:  # lmkv's hit: what it loads beyond the engine's own
            self.cache.record_lookup(st.looked_up[0], num_external_tokens, st.looked_up[1])
        st.plan, st.looked_up = None, None  # the plan is the engine's now
        if num_external_tokens == 0:
            self._unpin(st)
            return
        st.load_to = request.num_computed_tokens + num_external_tokens
        st.load_from = st.load_to - num_external_tokens

    def build_connector_meta(self, scheduled: Iterable[tuple[Any, int]]) -> ConnectorMetadata:
        """``scheduled``: (request, num_new_tokens) for this step, with each request's
        ``num_computed_tokens`` as it stands before the step (loaded tokens included).
        Pins of requests looked up but not scheduled (waiting for blocks, preempted) are
        given back: their next lookup pins again."""
        meta = ConnectorMetadata()
        try:
            self._build_meta(scheduled, meta)
        except BaseException:  # the loads planned so far never run: their pins go back
            for load in meta.loads:
                self.cache.unpin(load.keys)
            raise
        finally:
            for rid in self.pinning:
                st = self.states.get(rid)
                if st is not None:
                    self._unpin(st)
            self.pinning.clear()
        return meta

    def _build_meta(self, scheduled: Iterable[tuple[Any, int]], meta: ConnectorMetadata) -> None:
        c = self.cache.chunk_size
        for request, num_new in scheduled:
            st = self._state(request)
            if st.pinned:
                keys, slots, skips, unused = [], [], [], []
                for i, key in enumerate(st.pinned):
                    start = (st.pinned_from + i) * c
                    # the last chunk may be loaded in part (up to the last prompt token), and
                    # an engine may have taken fewer tokens than offered: load [from, to) only
                    end = min(start + c, st.load_to)
                    if end <= max(start, st.load_from):
                        unused.append(key)
                        continue
                    keys.append(key)
                    slots.append(self._slots(request.block_ids, start, end))
                    skips.append(max(0, st.load_from - start))
                self.cache.unpin(unused)
                if keys:
                    meta.loads.append(LoadSpec(request.request_id, keys, slots, skips))
                st.pinned = []
            if st.blended or st.no_saves or not self.saves or not request.prompt_token_ids:
                continue  # (no prompt: a request whose KV lmkv cannot key, decode chunks included)
            if st.gap:
                meta.saves.append(SaveSpec(
                    request.request_id, [st.keys[i] for i in st.gap],
                    [self._slots(request.block_ids, i * c, (i + 1) * c) for i in st.gap],
                    st.keys[st.gap[0] - 1] if st.gap[0] else None, st.gap[0] * c, lossy=st.lossy))
                st.gap = range(0)
            # (no further than the tokens known: with speculative decoding and async
            # scheduling the engine counts draft positions ahead of them)
            done = min(request.num_computed_tokens + num_new, request.num_tokens)
            if not self.save_decode_cache:
                done = min(done, len(request.prompt_token_ids))
            full = done // c
            if full > st.saved_chunks:
                if full > len(st.keys):
                    try:
                        st.keys = self.cache.keys(request.all_token_ids[: full * c])
                    except Exception as e:  # saves are optional: this step's are skipped
                        log.warning("lmkv: request %s: not saving its new chunks (%s)",
                                    request.request_id, e)
                        continue
                idx = range(st.saved_chunks, full)
                meta.saves.append(SaveSpec(
                    request.request_id,
                    [st.keys[i] for i in idx],
                    [self._slots(request.block_ids, i * c, (i + 1) * c) for i in idx],
                    st.keys[st.saved_chunks - 1] if st.saved_chunks else None,
                    st.saved_chunks * c,
                    lossy=st.lossy,
                ))
                st.saved_chunks = full
            n = len(request.prompt_token_ids)
            self._fresh_tail(st, request)
            if (st.tail is not None and not st.tail_done and done >= n
                    and st.saved_chunks >= n // c):  # the prompt's partial last chunk
                whole = n // c * c
                meta.saves.append(SaveSpec(
                    request.request_id, [st.tail], [self._slots(request.block_ids, whole, n)],
                    st.keys[n // c - 1] if n >= c else None, whole, lossy=st.lossy))
                st.tail_done = True

    def _note_lossy(self, keys: list[str]) -> None:
        for key in keys:
            _remember(self.lossy_keys, key, None)

    def _note_lossy_tail(self, parent: str, length: int) -> None:
        _remember(self.lossy_tails, parent, set()).add(length)

    def _engine_hit_lossy_tail(self, prompt: list[int], keys: list[str], computed: int) -> bool:
        """Whether the engine's hit (``computed`` tokens) reaches into a partial last chunk
        that another request with the same tokens loaded lossy."""
        if not self.lossy_tails:
            return False
        c = self.cache.chunk_size
        for i in range(min(-(-computed // c), len(keys) + 1)):  # chunk i starting a tail
            for length in self.lossy_tails.get(keys[i - 1] if i else "", ()):
                end = i * c + length
                if end <= len(prompt) and self.cache.tail_key(prompt[:end]) in self.lossy_keys:
                    return True
        return False

    def _engine_hit_lossy(self, keys: list[str]) -> bool:
        """Whether any of ``keys`` (chunks the engine's own prefix cache serves) was loaded
        lossy for an earlier request: those blocks hold its approximate KV (or an exact copy
        computed since; counted as lossy all the same)."""
        return any(key in self.lossy_keys for key in keys)

    def served_lossy(self, request: Any) -> bool:
        """Whether KV decoded from a lossy codec was loaded for ``request`` (ask before
        request_finished). The quality gate re-runs a sample of such requests."""
        st = self.states.get(request.request_id)
        return st is not None and st.lossy

    def request_finished(self, request: Any) -> tuple[bool, dict | None]:
        """The request left the engine: drop its state. Its blocks may be freed at once."""
        st = self.states.pop(request.request_id, None)
        if st is not None:
            self._unpin(st)
            self._drop_plan(st)
            self._let_go(st)
        if self.cache.config.kv_role == "producer":
            # the consumer may ask as soon as this request is reported done
            self.cache.drain()
        return False, None

    def reset(self) -> None:
        """The engine's weights may have changed in place (vLLM's reset_cache, after a
        weight update): no chunk stored so far is loaded again, and requests known now
        neither load nor save through lmkv (their KV may be the old weights')."""
        self.cache.new_epoch()
        self.forget_lossy()
        for st in self.states.values():
            self._unpin(st)
            self._drop_plan(st)
            self._let_go(st)
            st.no_loads = st.no_saves = True
            st.gap = range(0)

    def forget_lossy(self) -> None:
        """Forget which chunks were loaded lossy (the engine's pages that held them are gone:
        its prefix cache was reset)."""
        self.lossy_keys.clear()
        self.lossy_tails.clear()

    def recompute_without_loads(self, request: Any) -> None:
        """A load into ``request``'s pages failed and the engine computes it again from its
        first token: start its state afresh, and load nothing for it from now on. Its
        blocks stay salted in the engine (and what was blended stays unsaved)."""
        old = self.states.get(request.request_id)
        self.request_finished(request)
        st = self._new_state(request)
        st.no_loads = True
        if old is not None:
            st.salted, st.blended, st.no_saves = old.salted, old.blended, old.no_saves
        self.states[request.request_id] = st

    @staticmethod
    def _let_go(st: _RequestState) -> None:
        """Release the chunks held in the hot cache since they were read up for the request."""
        if st.bringing is not None:
            st.bringing.release()
            st.bringing = None

    def _state(self, request: Any) -> _RequestState:
        st = self.states.get(request.request_id)
        if st is None:
            st = self.states[request.request_id] = self._new_state(request)
        return st

    def _new_state(self, request: Any) -> _RequestState:
        prompt = request.prompt_token_ids
        tail = self.cache.tail_key(prompt) if self.save_tail and prompt else None
        return _RequestState(self.cache.keys(prompt), tail=tail, tail_of=len(prompt))

    def _fresh_tail(self, st: _RequestState, request: Any) -> None:
        """Make ``st.tail`` the key of the prompt's partial last chunk as the prompt is now:
        a streaming session extends a request's prompt in place, and the key made for the
        shorter prompt names other tokens."""
        prompt = request.prompt_token_ids
        if st.tail_of != len(prompt) and self.save_tail:
            st.tail = self.cache.tail_key(prompt) if prompt else None
            st.tail_of, st.tail_done = len(prompt), False

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """[end - start] int64 paged-memory slots of tokens [start, end)."""
        bs = self.block_size
        if len(block_ids) * bs < end:
            raise ValueError(f"tokens [{start}, {end}) need {-(-end // bs)} blocks, the request has "
                             f"{len(block_ids)}")
        blocks = torch.tensor(block_ids[start // bs : -(-end // bs)], dtype=torch.int64)
        offsets = torch.arange(bs, dtype=torch.int64)
        return (blocks[:, None] * bs + offsets[None, :]).flatten()[: end - start]

    @staticmethod
    def _drop_plan(st: _RequestState) -> None:
        if st.plan is not None:
            st.plan.release()
            st.plan = None

    def _unpin(self, st: _RequestState) -> None:
        if st.pinned:
            self.cache.unpin(st.pinned)
        st.pinned = []
