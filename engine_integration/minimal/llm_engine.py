"""LLMEngine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from lmkv.memory import zeros_in_memory

from .blend import continuation_logits
from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .default_model import DEFAULT_MODEL_NAME, resolve_model
from .device import default_dtype, resolve_device
from .gguf_loader import GGUFCheckpoint, is_gguf
from .loader import load_model
from .metrics import EngineMetrics
from .model_config import ModelConfig, parse_dtype
from .model_runner import ModelRunner
from .outputs import RequestOutput, hold_back
from .request import FinishReason, Request
from .sampling_params import OutputKind, SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from lmkv.config import LMKVConfig

log = logging.getLogger(__name__)

CUMULATIVE, DELTA, FINAL_ONLY = OutputKind.CUMULATIVE, OutputKind.DELTA, OutputKind.FINAL_ONLY
MAX_HELD_RUN = 64  # byte-fallback tokens a stream holds back at most (16 characters or more)
CONTEXT_TOKENS = 4  # prompt tokens decoded before the output's first ones (_decode)
DEFAULT_BATCHED_TOKENS = 2048  # tokens per step with chunked prefill, unless configured


class LLMEngine:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None,
                 lmkv_config: LMKVConfig | None = None):
        self.config = config
        if lmkv_config is not None and lmkv_config.chunk_size % config.block_size:
            raise ValueError(  # (told now, not after the model and lmkv's memory are set up)
                f"lmkv chunk_size {lmkv_config.chunk_size} must be a multiple of the engine's "
                f"block size {config.block_size}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model(config.model)
        gguf = GGUFCheckpoint(model_dir) if is_gguf(model_dir) else None
        if not model_dir.exists():
            raise FileNotFoundError(f"model {model_dir} does not exist")
        if gguf is None and not model_dir.is_dir():
            raise ValueError(f"model {model_dir} is neither a checkpoint directory nor a GGUF file")
        self.model_dir = model_dir  # a checkpoint directory or a .gguf file
        self.model_config = mc = gguf.model_config() if gguf else ModelConfig.from_dir(model_dir)
        self.model_name = config.served_model_name or config.model or DEFAULT_MODEL_NAME
        self.device = device = resolve_device(config.device)
        self.dtype_name = config.dtype if config.dtype != "auto" else default_dtype(device)
        self.dtype = parse_dtype(self.dtype_name)
        if (self.dtype is torch.bfloat16 and device.torch.type == "cuda"
                and torch.cuda.get_device_capability(device.torch) < (8, 0)):
            log.warning("--dtype bfloat16 on %s, a GPU before Ampere: its bfloat16 is emulated "
                        "(slow); --dtype float16 (or auto) runs natively", device.torch)
        self.tokenizer = (gguf.tokenizer() if gguf
                          else Tokenizer.from_dir(model_dir, mc.eos_token_ids))

        block_bytes = 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim
        block_bytes *= self.dtype.itemsize
        num_blocks = config.num_kv_blocks or config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {config.kv_cache_memory} bytes holds no block "
                f"({block_bytes} bytes each)"
            )
        capacity = num_blocks * config.block_size
        max_len = config.max_model_len or min(mc.max_position_embeddings, capacity)
        if max_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        if max_len > capacity:
            raise ValueError(
                f"max_model_len {max_len} does not fit the KV memory ({num_blocks} blocks of "
                f"{config.block_size} tokens = {capacity} tokens); raise kv_cache_memory"
            )
        budget = config.max_num_batched_tokens or (
            DEFAULT_BATCHED_TOKENS if config.enable_chunked_prefill else max_len)
        if not config.enable_chunked_prefill and budget < max_len:
            raise ValueError(  # a longer prompt (or a recompute) would never be scheduled
                f"without chunked prefill, max_num_batched_tokens ({budget}) must be at least "
                f"max_model_len ({max_len})"
            )
        self.max_model_len = max_len

        # RoPE tables for the positions this engine runs (a model's context may be millions)
        if gguf:
            with gguf:  # unmapped once its weights are copied out
                model = gguf.load_model(mc, self.dtype, max_len)
        else:
            model = load_model(model_dir, mc, self.dtype, max_len)
        # [L, 2, num_blocks, block_size, Hkv, D]; zeros touches every page now, not mid-request
        shape = (mc.num_layers, 2, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        try:
            self.model = model.to(device.torch)
            self.model.model.rope.to(device.torch)
            if device.torch.type == "cpu":
                self.kv_cache = zeros_in_memory(shape, self.dtype, "kv_cache_memory (--kv-cache-memory)")
            else:
                self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=device.torch)
        except torch.OutOfMemoryError as e:
            kv_bytes = math.prod(shape) * self.dtype.itemsize
            raise ValueError(
                f"out of GPU memory on {device.torch} for the model's weights and "
                f"{kv_bytes / 1e9:.3g} GB of KV memory (kv_cache_memory, --kv-cache-memory): give "
                f"less, or free the GPU (another process may hold it: nvidia-smi) ({e})") from e
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.metrics = metrics or EngineMetrics()
        self.kv_connector = None
        if lmkv_config is not None:
            from .kv_connector import KVConnector

            self.kv_connector = KVConnector(
                lmkv_config, self.model_config, self.dtype, config.block_size, model_dir,
                self.kv_cache, self.metrics.registry, self.tokenizer.encode, device.launcher,
            )
            self.kv_connector.forget_cached_pages = self._forget_lossy_pages
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
            self.kv_connector.scheduler if self.kv_connector else None,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, device.launcher)
        if (device.torch.type == "cuda" or device.launcher is not None) and not config.enforce_eager:
            self.runner.graphs = self._capture_graphs(config, max_len, device.launcher)
        self.requests: dict[str, Request] = {}
        log.info(
            "engine ready on %s: model %s (%d layers, %d/%d heads, head_dim %d, %s), KV memory %d "
            "blocks x %d tokens, max_model_len %d",
            "emulated CUDA" if device.launcher else device.torch, model_dir, mc.num_layers,
            mc.num_heads, mc.num_kv_heads, mc.head_dim,
            self.dtype_name, num_blocks, config.block_size, max_len,
        )
        if self.kv_connector is not None:
            self._check_hot_cache(max_len)

    def _check_hot_cache(self, max_len: int) -> None:
        """Warn where lmkv's CPU memory holds fewer chunks than one longest prompt: such a
        prompt's load stops short, and waiting requests push each other's chunks out before
        they load (read again from the tiers below at each step)."""
        cache = self.kv_connector.cache
        need = -(-max_len // cache.chunk_size)
        if cache.pool.num_slots < need:
            gb = math.ceil(need * cache.pool.slot_bytes / 1e7) / 100  # rounded up
            log.warning(
                "lmkv: max_local_cpu_size holds %d chunks of %d tokens, fewer than one "
                "max_model_len prompt (%d chunks): long prompts load in part and concurrent "
                "requests evict each other's chunks; give it at least %.2f GB",
                cache.pool.num_slots, cache.chunk_size, need, gb)

    def _capture_graphs(self, config: EngineConfig, max_len: int, launcher) -> DecodeGraphs | None:
        graphs = DecodeGraphs(self.model, self.kv_cache, config.block_size, max_len,
                              config.max_num_seqs, launcher)
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - the engine still runs, eagerly
            log.warning("could not capture CUDA graphs of the decode step (%s: %s): decode steps "
                        "run eagerly", type(e).__name__, e)
            return None
        return graphs

    # ---- requests -------------------------------------------------------------------
    def _forget_lossy_pages(self) -> None:
        """lmkv's quality gate tripped: no page stays findable in the prefix cache (any may
        hold, or be computed over, lossy KV), and the requests served lossy that still run
        register none of theirs from now on (their later pages are computed over it too)."""
        for req in self.requests.values():
            if self.kv_connector.scheduler.served_lossy(req):
                req.cacheable = False
        self.block_manager.reset_prefix_cache()

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        *, use_cache: bool = True,
    ) -> Request:
        """Queue a request (``use_cache=False``: no cached KV read, none saved). Raises
        ValueError naming what is wrong with it."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                "(max_model_len), including at least one generated token"
            )
        req = Request(request_id, ids, params, arrival=time.monotonic(), use_cache=use_cache)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(ids))
        self._update_gauges()  # waiting now, though the step that admits it may take seconds
        return req

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As the tokenizer does, except where lmkv's blending splits the prompt into the
        chunks it precomputed. Thread-safe."""
        ids = self.kv_connector.tokenize(text, add_special_tokens) if self.kv_connector else None
        return ids if ids is not None else self.tokenizer.encode(text, add_special_tokens)

    @property
    def blend_separator(self) -> list[int]:
        """The ids that join a blended prompt's segments (prompts sent as ids use them)."""
        return self.kv_connector.blend_separator if self.kv_connector else []

    @property
    def rope_inv_freq(self) -> torch.Tensor:
        """The keys' rotary inverse frequencies [D/2] (lmkv's KVComputer)."""
        return self.model.model.rope.inv_freq.cpu()

    def continuation_logits(self, tokens: list[int], prefix_kv: torch.Tensor) -> torch.Tensor:
        """Logits [n - P, vocab] of ``tokens[P:]`` over the given KV of ``tokens[:P]``
        (lmkv's KVComputer; keys rotated to their positions, as compute_kv returns them), in
        any dtype (taken in the model's)."""
        prefix_kv = prefix_kv.to(self.device.torch, self.dtype)
        return continuation_logits(self.model, tokens, prefix_kv).cpu()

    def compute_kv(self, token_lists: list[list[int]], pre_rope: bool = False) -> list[torch.Tensor]:
        """KV of each token list computed alone at positions [0, n): [2, L, n, Hkv, D] each,
        with ``pre_rope`` the keys before RoPE (lmkv.blend.precompute's KVComputer)."""
        reqs = []
        try:  # a rejected list (or a failed step) leaves none of these requests behind
            for i, ids in enumerate(token_lists):
                # computed alone: no cached KV loaded or blended, none stored as prefix chunks
                req = self.add_request(f"kv-{id(token_lists)}-{i}", ids, SamplingParams(max_tokens=1),
                                       use_cache=False)
                req.capture_kv = True
                reqs.append(req)
            while any(not r.is_finished for r in reqs):
                self.step()
        except BaseException:
            for req in reqs:
                self.abort_request(req.request_id)
            raise
        kvs = [r.captured_kv for r in reqs]
        if pre_rope:  # rotated back from [0, n) in fp32: exact up to one rounding to the dtype
            rope = self.model.model.rope
            dev = self.device.torch
            for kv in kvs:
                back = rope.rotate(kv[0].to(dev), torch.arange(kv.shape[2], device=dev), inverse=True)
                kv[0] = back.cpu()
        return kvs

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)
            if self.kv_connector is not None:
                self.kv_connector.aborted(req)
            if not req.internal:
                self.metrics.requests_finished.labels("abort").inc()
            self._update_gauges()  # no step may follow to do it

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------
    def device_lost(self) -> BaseException | None:
        """After a failed step: the error that makes the engine's CUDA device unusable for
        good (a sticky error: an illegal address, an ECC error: every later call fails
        too), or None (the CPU; a device that still works)."""
        if self.device.torch.type != "cuda":
            return None
        try:
            torch.cuda.synchronize(self.device.torch)
        except Exception as e:
            return e
        return None

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        forward_before = self.runner.num_forward_tokens
        if self.kv_connector is not None:  # lookups of requests admitted now must find them
            sch = self.scheduler
            admits = bool(sch.waiting) and len(sch.running) < sch.config.max_num_seqs
            self.kv_connector.complete_saves(wait=admits)
        sched = self.scheduler.schedule()
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preemptions_before)
        # the gauges show the batch while it runs (a prefill may take seconds), not the last one's
        self._update_gauges()
        if not sched.scheduled:
            return []
        # sampling advances seeded generators: a request lmkv's failed load sends back to be
        # computed again must not see that (only lmkv's loads fail a request's step this way)
        seeded = {s.request.request_id: s.request.generator.get_state()
                  for s in sched.scheduled
                  if s.request.generator is not None and self.kv_connector is not None}
        try:
            if self.kv_connector is None:
                sampled = self.runner.execute(sched)
            else:
                sampled, failed, blocks = self.kv_connector.execute(self.runner, sched)
                if failed:  # they ran over pages lmkv failed to fill: recompute them from scratch
                    self.block_manager.forget(_downstream(failed, blocks))
                    for req in reversed(failed):
                        self.scheduler.requeue(req)
                        self.kv_connector.recompute(req)
                        if req.request_id in seeded:
                            req.generator.set_state(seeded[req.request_id])
                    sched.scheduled = [s for s in sched.scheduled if s.request not in failed]
        except BaseException:
            # the pages this step was writing hold partial KV, though their hashes sit in the
            # prefix cache since allocation: no later prompt may hit them
            self.block_manager.forget({b for s in sched.scheduled for b in s.request.block_ids})
            raise
        outputs = self._postprocess(sched, sampled)
        if self.kv_connector is not None and not self.scheduler.has_unfinished():
            self.kv_connector.complete_saves(wait=True)  # idle next: nothing would poll them
        # (a blended prompt's reused tokens not recomputed are not: the runner counts)
        self.metrics.computed_tokens.inc(self.runner.num_forward_tokens - forward_before)
        self._update_gauges()
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        return outputs

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.kv_usage.set(self.block_manager.usage)

    def _postprocess(self, sched: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        """Each request's sampled token in; outputs out. O(new tokens) per request (but for
        OutputKind.CUMULATIVE outputs, which copy everything so far)."""
        outputs = []
        generated = 0
        for s in sched.scheduled:
            req = s.request
            first = req.num_cached_tokens + req.num_external_tokens  # the prompt's first step
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens == first + s.num_new_tokens and (
                req.num_preemptions == 0 and not req.output_token_ids
            ):
                self.metrics.prefix_cache_hit_tokens.inc(req.num_cached_tokens)
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk: nothing sampled yet
            if not req.output_token_ids and not req.internal:
                self.metrics.ttft.observe(time.monotonic() - req.arrival)
                if req.capture_kv:
                    slots = self.runner.slots(req, 0, req.num_prompt_tokens)
                    # [L, 2, n, Hkv, D] -> [2, L, n, Hkv, D]
                    kv = self.kv_cache.flatten(2, 3)[:, :, slots.to(self.kv_cache.device)]
                    req.captured_kv = kv.transpose(0, 1).contiguous().cpu()  # lmkv stores host chunks
            req.output_token_ids.append(token)
            generated += not req.internal
            reason = self._check_stop(req, token)
            if reason is not None:
                rerun = self.kv_connector.request_finished(req) if self.kv_connector else None
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
                if not req.internal:
                    self.metrics.requests_finished.labels(reason.value).inc()
                if rerun is not None:
                    self.requests[rerun.request_id] = rerun
                    self.scheduler.add(rerun)
            if not req.internal and (req.is_finished or req.params.output_kind is not FINAL_ONLY):
                outputs.append(self._output(req))
        self.metrics.generation_tokens.inc(generated)
        return outputs

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        new = self._new_text(req)
        # a new match starts at most (longest stop - 1) characters before the new text
        window = req.stop_window + new
        keep = max(map(len, p.stop), default=1) - 1
        req.stop_window = window[-keep:] if keep else ""
        if p.output_kind is CUMULATIVE:
            req.output_text += new
        elif p.output_kind is DELTA:
            req.unsent_text += new
        reason = None
        eos = not p.ignore_eos and token in self.tokenizer.eos_token_ids
        stop_string = bool(p.stop) and any(s in window + req.held_text for s in p.stop)
        if stop_string or token in p.stop_token_ids or eos:
            reason = FinishReason.STOP
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:  # the final text: the whole output decoded at once, cut at
            text = self._decode(req, 0, len(req.output_token_ids))  # the first stop string in it
            held = req.held_text  # a character whose bytes the output ends before all came
            if held and not held.strip("\ufffd") and text.endswith(held):
                text = text[: -len(held)]  # (it never completes: left out, as vLLM does)
            hits = [(i, i + len(s)) for s in p.stop if (i := text.find(s)) >= 0]
            start, end = min(hits, default=(len(text), len(text)))
            req.output_text = text[: end if p.include_stop_str_in_output else start]
            if hits:
                reason = FinishReason.STOP
        return reason

    def _new_text(self, req: Request) -> str:
        """The text the newest output token adds: tokens [detok_prefix, detok_read) are
        decoded again with the newer ones, for context (a leading space, a character whose
        bytes span tokens), and the difference is the new text, so each token costs a few
        tokens' decoding, not the whole output's. What may still change is held back (and
        what it decodes to for now is left in ``req.held_text``, for stop strings): a
        character still incomplete (decoded as U+FFFD), and a trailing run of byte-fallback
        tokens (Tokenizer.byte_fallback_ids), up to MAX_HELD_RUN of them; the complete text
        before them is not."""
        ids = req.output_token_ids
        end = len(ids)
        run = self.tokenizer.byte_fallback_ids
        floor = max(req.detok_read, end - MAX_HELD_RUN)  # a longer run is let through
        while run and end > floor and ids[end - 1] in run:
            end -= 1
        first = req.detok_prefix
        before = self._decode(req, first, req.detok_read) if req.detok_read else ""
        added = self._decode(req, first, end)[len(before) :] if end > req.detok_read else ""
        req.held_text = ""
        if end < len(ids):  # the held run as it decodes for now
            now = self._decode(req, first, len(ids))[len(before) :]
            req.held_text = now[len(added) :] if now.startswith(added) else now
        if end == req.detok_read:
            return ""
        if not added.endswith("\ufffd"):
            req.detok_prefix, req.detok_read = req.detok_read, end
            out, req.detok_sent = added[req.detok_sent :], 0
            return out
        complete = added.rstrip("\ufffd")
        out, req.detok_sent = complete[req.detok_sent :], max(req.detok_sent, len(complete))
        req.held_text = added[len(complete) :] + req.held_text
        return out

    def _decode(self, req: Request, start: int, stop: int) -> str:
        """The text of output tokens [start, stop); from the first, as the prompt's last
        tokens decoded with them give it (a SentencePiece decoder, Llama 2's or Mistral's,
        drops the leading space of what it decodes: "▁Paris" alone is "Paris")."""
        ids = req.output_token_ids[start:stop]
        context = req.prompt_token_ids[-CONTEXT_TOKENS:] if start == 0 else []
        if context:
            head = self.tokenizer.decode(context)
            text = self.tokenizer.decode(context + ids)
            if "\ufffd" not in head and text.startswith(head):  # (else: a prompt ending
                return text[len(head) :]  # inside a character, decoded alone)
        return self.tokenizer.decode(ids)

    def _output(self, req: Request) -> RequestOutput:
        kind = req.params.output_kind
        ids = req.output_token_ids
        if kind is DELTA:
            new_ids, req.sent_tokens = ids[req.sent_tokens :], len(ids)
            if req.is_finished:  # the final text's rest (the deltas add up to the final text,
                text = req.output_text[req.sent_chars :]  # but where bytes were invalid)
            else:  # what can no longer change or become a stop string
                text = hold_back(req.unsent_text, req.params.stop)
                req.unsent_text = req.unsent_text[len(text) :]
            req.sent_chars += len(text)
        else:  # (_new_text never gives an incomplete character: nothing to hold back here)
            new_ids, text = list(ids), req.output_text
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=new_ids,
            text=text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=req.num_cached_tokens,
            num_external_tokens=req.num_external_tokens,
            num_output_tokens=len(ids),
        )

    def close(self) -> None:
        """Finish lmkv's background writes and release its resources."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None


def _downstream(failed, blocks: set[int]) -> set[int]:
    """The blocks whose prefix-cache entries a failed load spoils: the blocks it was writing,
    and every later block of each request that ran over them (computed over unfilled pages
    this step, though registered in the prefix cache when they were allocated)."""
    out = set(blocks)
    for req in failed:
        ids = list(req.block_ids)
        first = next((i for i, b in enumerate(ids) if b in blocks), None)
        if first is not None:
            out.update(ids[first:])
    return out
