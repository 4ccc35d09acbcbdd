"""The engine's OpenAI-compatible HTTP API: FastAPI routes over an AsyncEngine."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .async_engine import AsyncEngine, EngineError, EngineStoppedError, QueueFullError
from .body_limit import BodyLimit
from .default_model import DEFAULT_MODEL_NAME
from .event_stream import DONE, EventStream, sse
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    usage_chunk,
)
from .outputs import RequestOutput
from .sampling_params import OutputKind, SamplingParams
from .server_config import ServerConfig
from .server_metrics import MetricsMiddleware, ServerMetrics

if TYPE_CHECKING:  # torch is imported only once the config is known to be good
    from .llm_engine import LLMEngine

log = logging.getLogger(__name__)

ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
DISCONNECT_POLL_S = 1.0  # how often a request not streaming yet checks for a gone client
TOKENIZERS = 2  # prompts tokenized at once (each holds the GIL while it runs)


class APIError(Exception):
    """Answered as an OpenAI-style error body with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class StartupError(Exception):
    """The server cannot start; the message says why."""


class APIServer:
    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.engine = engine
        self.model_name = engine.model_name
        self.metrics = ServerMetrics(engine.metrics.registry)
        self.async_engine = AsyncEngine(engine, config.max_in_flight, self.metrics)
        self.created = int(time.time())
        # a prompt longer than this many characters cannot fit the context: refused before
        # it is tokenized (a multi-megabyte prompt would hold the GIL for seconds)
        self.max_prompt_chars = engine.max_model_len * engine.tokenizer.max_token_chars
        self._tokenizing: asyncio.Semaphore | None = None  # made on the event loop
        self._waiting = 0  # requests waiting for, or in, tokenization (event loop only)

        app = FastAPI(title="lmkv engine", lifespan=self._lifespan)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model_card, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_exception_handler(APIError, _api_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(HTTPException, _http_error)
        app.add_exception_handler(Exception, _unexpected_error)
        app.add_middleware(BodyLimit, limit=config.max_request_body, budget=config.request_bodies_budget,
                           timeout=config.request_body_timeout)
        app.add_middleware(MetricsMiddleware, metrics=self.metrics, endpoints=ENDPOINTS)
        self.app = app

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.async_engine.start()
        try:
            yield
        finally:
            self.async_engine.shutdown()

    # ---- plain endpoints ------------------------------------------------------------
    async def health(self) -> Response:
        if not self.async_engine.is_alive:
            raise APIError(503, "the engine is not running")
        return Response(status_code=200)

    async def prometheus(self) -> Response:
        text = generate_latest(self.engine.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model: str) -> dict[str, Any]:
        """OpenAI's retrieve-model (``client.models.retrieve``): the served model's card."""
        self._check_model(model)
        return self._card()

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name, "object": "model", "created": self.created,
            # the model as asked for (vLLM's root), not where it was found on this machine
            "owned_by": "lmkv", "root": self.engine.config.model or DEFAULT_MODEL_NAME,
            "max_model_len": self.engine.max_model_len,
        }

    # ---- generation -----------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        prompts: list[list[int]] = []
        try:
            body.check_supported()
            texts = body.prompts()
            limit = self.async_engine.max_in_flight
            if len(texts) > limit:
                raise ValueError(f"prompt holds {len(texts)} prompts: more than this server "
                                 f"takes in flight at once ({limit}, --max-num-seqs + "
                                 "--max-pending)")
            params = body.sampling_params(body.max_tokens)
            self._check_room(self._waiting + len(texts) - 1)  # (503 for the batch, counted once)
            for text in texts:
                prompts.append(text if isinstance(text, list) else
                               await self._tokenized(self.engine.tokenize, text, len(text)))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        for prompt in prompts:
            self._check_length(prompt, params.max_tokens)
        return await self._generate(request, body, prompts, params, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        try:
            body.check_supported()
            messages = body.template_messages()
            chars = sum(len(m["content"]) + len(m["role"]) for m in messages)  # all rendered
            prompt = await self._tokenized(self._chat_prompt, messages, chars)
            max_tokens = body.max_completion_tokens
            if max_tokens is None:
                max_tokens = body.max_tokens
            if max_tokens is not None:
                self._check_length(prompt, max_tokens)
            # no limit asked: the context's end stops the request
            params = body.sampling_params(
                max(1, self.engine.max_model_len - len(prompt)) if max_tokens is None else max_tokens
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return await self._generate(request, body, [prompt], params, chat=True)

    async def _tokenized(self, tokenize, text, chars: int) -> list[int]:
        """``tokenize(text)`` off the event loop and the engine thread, TOKENIZERS at a
        time, once the server has room for the request (503 otherwise) and the text could
        fit the context (400 otherwise)."""
        self._check_chars(chars)
        self._check_room(self._waiting)  # those waiting to be tokenized count
        if self._tokenizing is None:
            self._tokenizing = asyncio.Semaphore(TOKENIZERS)
        self._waiting += 1
        try:
            async with self._tokenizing:
                self._check_room(0)
                return await asyncio.to_thread(tokenize, text)
        finally:
            self._waiting -= 1

    def _check_room(self, waiting: int) -> None:
        engine = self.async_engine
        if engine.num_in_flight + waiting >= engine.max_in_flight:
            self.metrics.rejected.inc()
            raise APIError(503, f"the server is at capacity ({engine.max_in_flight} requests "
                                "in flight); retry later")

    def _check_length(self, prompt: list[int], max_tokens: int) -> None:
        """Refuse (400) a request whose prompt and max_tokens do not fit the context."""
        limit = self.engine.max_model_len
        if len(prompt) >= limit:  # no max_tokens would fit: the prompt is what is too long
            raise APIError(400, f"This model's maximum context length is {limit} tokens "
                           f"(max_model_len), but the prompt has {len(prompt)}: the context "
                           "must hold at least one generated token too", param="prompt")
        if len(prompt) + max_tokens > limit:
            raise APIError(  # (worded as vLLM's: clients tell context errors by it)
                400, f"This model's maximum context length is {limit} tokens (max_model_len), but "
                f"{len(prompt) + max_tokens} were requested: {len(prompt)} in the prompt and "
                f"max_tokens {max_tokens}; at most {max(0, limit - len(prompt))} can be generated "
                "after this prompt", param="max_tokens")

    def _check_chars(self, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(
                f"the prompt holds {chars} characters: more than this model's context of "
                f"{self.engine.max_model_len} tokens can hold (a token here is at most "
                f"{self.engine.tokenizer.max_token_chars} characters)")

    def _chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.engine.tokenizer
        for i, m in enumerate(messages):  # (the rendered prompt is tokenized as one text)
            for special in tok.control_tokens:
                if special in m["content"]:
                    raise ValueError(f"messages[{i}].content holds the special token {special!r}: "
                                     "it would be read as the control token (the chat template "
                                     "marks turns with it), not as text")
        text = tok.apply_chat_template(messages)
        # the template adds text around each message: many short ones render to several
        # times what their roles and contents hold (checked before the tokenizer's time)
        self._check_chars(len(text))
        return self.engine.tokenize(text, add_special_tokens=False)  # the template places BOS

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    async def _generate(
        self, request: Request, body: GenerationRequest, prompts: list[list[int]],
        params: SamplingParams, chat: bool,
    ) -> Response:
        """One engine request per prompt (choice i answers prompts[i]); all are aborted when
        one is refused or fails, or the client goes away."""
        if await request.is_disconnected():  # gone while it waited to be tokenized: no prefill
            return Response(status_code=499)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        # a stream sends what is new after each step; a response needs the finished output only
        params = replace(params, output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        streams = [self.async_engine.generate(r, p, params, announce=True)
                   for r, p in zip(ids, prompts, strict=True)]
        handed_on = False
        try:
            # refusals: 4xx/5xx before any byte; a stream starts once the engine took them all
            if await _accepted(streams, request) is None:
                return Response(status_code=499)  # the client went away; nobody reads this
            if body.stream:
                handed_on = True  # the event stream closes them
                return EventStream(self._events(rid, created, body, streams, chat))
            outs = await _last_outputs(streams, request)
            if outs is None:
                return Response(status_code=499)
            if chat:
                return JSONResponse(chat_response(rid, created, self.model_name, outs[0],
                                                  body.return_token_ids))
            return JSONResponse(completion_response(rid, created, self.model_name, outs,
                                                    body.return_token_ids))
        finally:
            if not handed_on:
                await _close(streams)  # aborts those not finished

    async def _events(
        self, rid: str, created: int, body: GenerationRequest,
        streams: list[AsyncIterator[RequestOutput]], chat: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new text of a prompt (the outputs are deltas),
        its last with finish_reason; the usage of all of them at the end when asked for."""
        model, ids = self.model_name, body.return_token_ids
        last: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                yield sse(chat_chunk(rid, created, model, role, None, [] if ids else None))
            # (closed before the streams: its waits on them end first)
            async with aclosing(_outputs(streams)) as outputs:
                async for i, out in outputs:
                    last[i] = out
                    delta, new_ids = out.text, out.output_token_ids if ids else None
                    if not (delta or new_ids or out.finished):
                        continue
                    if chat:
                        content = {"content": delta} if delta or not out.finished else {}
                        chunk = chat_chunk(rid, created, model, content, out.finish_reason, new_ids)
                    else:
                        chunk = completion_chunk(rid, created, model, delta, out.finish_reason,
                                                 new_ids, index=i)
                    yield sse(chunk)
        except EngineError as e:
            yield sse(error_body(str(e), 503 if isinstance(e, EngineStoppedError) else 500))
        except ValueError as e:  # (not expected once the engine took the request)
            yield sse(error_body(str(e), 400))
        else:
            if body.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield sse(usage_chunk(rid, created, model, obj, last))
        finally:
            await _close(streams)  # aborts those not finished
        yield DONE


async def _accepted(streams: list[AsyncIterator[RequestOutput | None]], request: Request
                    ) -> list[None] | None:
    """Wait until the engine took each request (they were made with ``announce``); None if
    the client disconnected first."""
    try:
        return await _unless_disconnected([anext(s) for s in streams], request)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except (QueueFullError, EngineStoppedError) as e:
        raise APIError(503, str(e)) from None
    except EngineError as e:
        raise APIError(500, str(e)) from None


async def _last_outputs(streams: list[AsyncIterator[RequestOutput]], request: Request
                        ) -> list[RequestOutput] | None:
    """Each stream's finished output; None if the client disconnected first."""

    async def drain(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        async for out in outputs:  # noqa: B007 - the last one is the answer
            pass
        return out

    try:
        return await _unless_disconnected([drain(s) for s in streams], request)
    except EngineStoppedError as e:
        raise APIError(503, str(e)) from None
    except EngineError as e:
        raise APIError(500, str(e)) from None


async def _outputs(streams: list[AsyncIterator[RequestOutput]]
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(i, output) of every stream as they come; ends when all finished."""
    if len(streams) == 1:  # (no task per output)
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                out = task.result()  # (an engine error ends them all)
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        await _cancelled(pending)


async def _unless_disconnected(coros: list, request: Request) -> list | None:
    """The coroutines' results, or None if the client disconnects first; the first to
    raise ends the others. Those not done are cancelled (inside generate(), which aborts
    the request)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S,
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t in done and t.exception() is not None]
            if failed:  # (the first prompt's error, whatever order they came in)
                raise failed[0].exception()
            if not pending:
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                return None
    finally:
        await _cancelled(tasks)


async def _cancelled(tasks) -> None:
    """Cancel the tasks not done and wait until they are."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for outputs in streams:
        await outputs.aclose()  # aborts the request unless it finished


# ---- error bodies -------------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = {"Retry-After": "1"} if exc.status == 503 else None  # busy or stopping: retry
    return JSONResponse(error_body(exc.message, exc.status, exc.param), status_code=exc.status,
                        headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if "json" not in request.headers.get("content-type", ""):
        message = "the request body must be JSON, sent with Content-Type: application/json"
        return JSONResponse(error_body(message, 400), status_code=400)
    parts: list[str] = []
    fields: set[str] = set()
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON: {detail}", 400),
                                status_code=400)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = loc[0] if loc else "body"
        if field not in fields:  # a union type reports once per alternative: keep the first
            fields.add(field)
            parts.append(f"{field}: {err.get('msg', 'invalid')}")
    param = next(iter(fields)) if len(fields) == 1 and "body" not in fields else None
    return JSONResponse(error_body("invalid request: " + "; ".join(parts), 400, param),
                        status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = str(exc.detail)
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
        bad = exc.__cause__
        message = f"the request body is not UTF-8: byte 0x{bad.object[bad.start]:02x} at offset {bad.start}"
    return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                        headers=exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A 500 that names an id to find in the server's log, not the exception (whose text may
    hold paths and internals). Starlette logs the traceback after sending this."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s on %s %s: %r", error_id, request.method, request.url.path, exc)
    return JSONResponse(
        error_body(f"internal server error (id {error_id}: the server's log has the details)", 500),
        status_code=500)


# ---- the program ----------------------------------------------------------------------
def serve(config: ServerConfig) -> None:
    """Load the model and serve HTTP until interrupted. Raises StartupError."""
    # SIGTERM is a requested stop, not a failure (make, systemd and the like would report
    # one): exit with status 0, also after uvicorn's graceful shutdown, which raises the
    # signal again
    signal.signal(signal.SIGTERM, _stopped)
    sock = _listen(config.host, config.port)  # before the model loads: a port in use fails fast
    try:
        lmkv_config = None
        if config.lmkv_config_file is not None:
            from lmkv.config import load_config

            lmkv_config = load_config(config.lmkv_config_file)
            log.info("lmkv is on (LMKV_CONFIG_FILE=%s): %s", config.lmkv_config_file,
                     lmkv_config.describe())
        else:
            from lmkv.config import off_but_configured

            if warning := off_but_configured():
                log.warning("%s", warning)
            else:
                log.info("lmkv is off: LMKV_CONFIG_FILE is not set (e.g. "
                         "LMKV_CONFIG_FILE=examples/local_cpu_disk.yaml turns it on)")
        from .llm_engine import LLMEngine

        engine = LLMEngine(config.engine, lmkv_config=lmkv_config)
    except (OSError, ValueError) as e:
        sock.close()
        raise StartupError(str(e)) from e
    import uvicorn

    from lmkv.http_limits import bounded_http

    server = APIServer(engine, config)
    log.info("serving %s on http://%s:%d", server.model_name, config.host, config.port)
    interrupt = signal.signal(signal.SIGINT, _stopped)  # while serving, Ctrl-C stops cleanly
    try:
        _uvicorn_server(uvicorn.Config(
            server.app, host=config.host, port=config.port, log_level=config.log_level,
            timeout_graceful_shutdown=config.graceful_shutdown_timeout,
            # idle connections closed after keep-alive's 5 s, a request head due within the
            # body's time: a client that connects and sends nothing holds no descriptor
            http=bounded_http(config.max_connections, config.request_body_timeout),
        ), server.async_engine).run(sockets=[sock])
    except SystemExit as e:
        if e.code != 0:
            raise
    finally:
        signal.signal(signal.SIGINT, interrupt)  # a second Ctrl-C while lmkv drains interrupts
        close_engine(engine, server.async_engine)
    log.info("engine serve: stopped")


def close_engine(engine: LLMEngine, async_engine: AsyncEngine) -> bool:
    """lmkv finishes its background writes and lets go of its resources, unless the engine
    thread is still in a step the stop did not end (a long prefill): lmkv is in use there,
    so it is left as it is (its queued writes are lost as the process exits) rather than
    closed under that step. Whether it was closed."""
    if async_engine.in_step:
        log.error("engine serve: the engine is still in a step after the stop; exiting without "
                  "finishing lmkv's queued writes")
        return False
    engine.close()
    return True


def _uvicorn_server(config, async_engine: AsyncEngine):
    """uvicorn's server, whose graceful stop ends the requests still running near the end
    of the grace period with a 503 ("the server is shutting down": the engine stops), rather
    than letting uvicorn cancel their handlers (a plain-text 500 and a traceback)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            grace = self.config.timeout_graceful_shutdown
            stop = asyncio.get_running_loop().call_later(max(0.5, grace - 1),
                                                         async_engine.request_stop)
            try:
                await super().shutdown(sockets=sockets)
            finally:
                stop.cancel()

    return Server(config)


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it). Raises StartupError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = " (is another engine serve running?)" if e.errno == errno.EADDRINUSE else ""
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from e
    return sock


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)
