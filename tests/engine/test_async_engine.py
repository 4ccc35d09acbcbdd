"""AsyncEngine: the engine thread, the hand-off, back-pressure and failures; and how the
HTTP server answers an engine failure (uvicorn in a thread of this process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import httpx
import pytest

from lmkv_engines.minimal.api_server import APIServer
from lmkv_engines.minimal.async_engine import AsyncEngine, EngineError, QueueFullError
from lmkv_engines.minimal.config import EngineConfig
from lmkv_engines.minimal.llm_engine import LLMEngine
from lmkv_engines.minimal.sampling_params import SamplingParams
from lmkv_engines.minimal.server_config import ServerConfig
from lmkv_engines.minimal.server_metrics import ServerMetrics

from .test_api_server import free_port

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=16 << 20,
                                  max_num_seqs=1, max_model_len=1024))


async def _last(outputs):
    out = None
    async for out in outputs:  # noqa: B007
        pass
    return out


def _fail_next_step(engine: LLMEngine) -> None:
    real = engine.step

    def step():
        engine.step = real
        raise RuntimeError("injected step failure")

    engine.step = step


def test_queue_full_then_abort_frees_a_slot(engine):
    metrics = ServerMetrics(engine.metrics.registry)

    async def main():
        ae = AsyncEngine(engine, max_in_flight=2, metrics=metrics)
        ae.start()
        try:
            first = ae.generate("a", [5, 6, 7], LONG)
            assert len((await anext(first)).output_token_ids) >= 1
            # max_num_seqs=1: the second waits for the first to finish
            second = ae.generate("b", [8, 9], GREEDY)
            second_done = asyncio.ensure_future(_last(second))
            await asyncio.sleep(0.05)
            assert not second_done.done() and ae.num_in_flight == 2
            with pytest.raises(QueueFullError, match="2 requests in flight"):
                await anext(ae.generate("c", [1], GREEDY))
            await first.aclose()  # aborts "a"; "b" runs
            out = await asyncio.wait_for(second_done, 30)
            assert out.finished and len(out.output_token_ids) == 8
            assert ae.num_in_flight == 0
            ok = await _last(ae.generate("d", [1], GREEDY))
            assert ok.finished
        finally:
            ae.shutdown()

    asyncio.run(main())
    assert metrics.rejected._value.get() == 1
    assert engine.metrics.requests_finished.labels("abort")._value.get() == 1
    assert not engine.has_unfinished_requests() and not engine.requests


def test_step_failure_fails_its_requests_and_the_engine_goes_on(engine):
    metrics = ServerMetrics(engine.metrics.registry)

    async def main():
        ae = AsyncEngine(engine, max_in_flight=8, metrics=metrics)
        ae.start()
        try:
            want = await _last(ae.generate("ref", [5, 6, 7], GREEDY))
            _fail_next_step(engine)
            runs = [_last(ae.generate(f"x{i}", [5, 6, 7], GREEDY)) for i in range(3)]
            results = await asyncio.gather(*runs, return_exceptions=True)
            assert all(isinstance(r, EngineError) for r in results), results
            assert ae.is_alive
            again = await _last(ae.generate("again", [5, 6, 7], GREEDY))
            assert again.output_token_ids == want.output_token_ids
            with pytest.raises(ValueError, match="empty"):
                await anext(ae.generate("empty", [], GREEDY))
        finally:
            ae.shutdown()
        assert not ae.is_alive
        with pytest.raises(EngineError, match="not running"):
            await anext(ae.generate("late", [1], GREEDY))

    asyncio.run(main())
    assert metrics.step_errors._value.get() == 1
    assert not engine.has_unfinished_requests()


def test_shutdown_fails_requests_in_flight(engine):
    async def main():
        ae = AsyncEngine(engine, max_in_flight=8)
        ae.start()
        outputs = ae.generate("a", [5, 6, 7], LONG)
        await anext(outputs)
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineError, match="stopped"):
            await _last(outputs)

    asyncio.run(main())


def test_http_engine_failure_is_a_500_and_the_server_keeps_serving(engine):
    import uvicorn

    api = APIServer(engine, ServerConfig(engine=engine.config, max_pending=0))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]

        _fail_next_step(engine)
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "the engine failed while running this request",
                                     "type": "InternalServerError", "param": None, "code": 500}
        assert httpx.get(f"{url}/health").status_code == 200

        # a bug outside the engine is a 500 with an OpenAI-style body too
        encode = engine.tokenizer.encode
        engine.tokenizer.encode = lambda *a, **k: 1 / 0
        r = httpx.post(f"{url}/v1/completions", json=body | {"prompt": "hi"})
        engine.tokenizer.encode = encode
        assert r.status_code == 500  # (its message names an id the log has: a test below)
        assert r.json()["error"]["message"].startswith("internal server error (id ")

        # max_num_seqs=1 and max_pending=0: a second request while one streams is refused
        real_step = engine.step
        engine.step = lambda: time.sleep(0.005) or real_step()  # the stream outlasts the test
        with httpx.stream("POST", f"{url}/v1/completions",
                          json=body | {"max_tokens": 1000, "stream": True}) as stream:
            lines = stream.iter_lines()  # held: dropping it would close the stream
            assert next(lines).startswith("data: ")
            busy = httpx.post(f"{url}/v1/completions", json=body)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert "capacity" in busy.json()["error"]["message"]
        while "api_generations_in_flight 0.0" not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline + 30, "the closed stream was not aborted"
            time.sleep(0.05)
        engine.step = real_step
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        text = httpx.get(f"{url}/metrics").text
        assert "api_engine_step_errors_total 1.0" in text
        assert "api_generations_rejected_total 1.0" in text
    finally:
        server.should_exit = True
        thread.join(30)


def _serve_in_thread(api: APIServer):
    """(url, stop) of uvicorn serving ``api`` in a thread of this process."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{port}", stop


def test_clients_that_give_up_while_queued_are_aborted_and_free_their_slots(engine):
    """max_num_seqs=1: while one request streams, two more wait in the queue; their clients
    time out. They are aborted (never prefilled for nobody) and their admission slots come
    back, so the next client is served, not refused."""
    api = APIServer(engine, ServerConfig(engine=engine.config, max_pending=2))
    url, stop = _serve_in_thread(api)
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    real_step = engine.step
    engine.step = lambda: time.sleep(0.005) or real_step()  # the stream outlasts the test
    try:
        with httpx.stream("POST", f"{url}/v1/completions",
                          json=body | {"max_tokens": 1000, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            for _ in range(2):
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
            deadline = time.monotonic() + 10
            aborted = engine.metrics.requests_finished.labels("abort")._value
            while ("api_generations_in_flight 1.0" not in httpx.get(f"{url}/metrics").text
                   or aborted.get() < 2):
                assert time.monotonic() < deadline, "the queued requests were not aborted"
                time.sleep(0.05)
            assert aborted.get() == 2
            with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, not refused
                httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    finally:
        engine.step = real_step
        stop()


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(engine):
    api = APIServer(engine, ServerConfig(engine=engine.config))
    url, stop = _serve_in_thread(api)
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    try:
        text = "x" * (engine.max_model_len * engine.tokenizer.max_token_chars + 1)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        assert not calls
    finally:
        engine.tokenizer.encode = encode
        stop()


def test_a_reader_that_falls_behind_gets_the_newest_output_only():
    """The engine thread's outputs for one request: an unread one is replaced by the next
    (each holds everything so far), a final one is kept."""
    from lmkv_engines.minimal.async_engine import _Mailbox
    from lmkv_engines.minimal.outputs import RequestOutput

    async def main():
        box = _Mailbox()
        outs = [RequestOutput("r", [1], list(range(i)), "x" * i, i == 5, None) for i in range(1, 6)]
        for out in outs[:3]:
            box.put(out)
        assert await box.get() is outs[2]
        box.put(outs[4])  # finished
        box.put(outs[3])  # (never after a final one; kept out anyway)
        assert await box.get() is outs[4]

    asyncio.run(main())


def test_a_reader_that_falls_behind_a_stream_gets_every_delta_joined():
    """Delta outputs (a stream's) that wait unread are joined into one: the reader gets
    every token and character it missed, once, then the final output after them."""
    from lmkv_engines.minimal.async_engine import _Mailbox
    from lmkv_engines.minimal.outputs import RequestOutput

    def delta(i, finished=False):
        return RequestOutput("r", [1], [i], f"<{i}>", finished, "stop" if finished else None,
                             num_output_tokens=i)

    async def main():
        box = _Mailbox(delta=True)
        for i in (1, 2, 3):
            box.put(delta(i))
        got = await box.get()
        assert (got.output_token_ids, got.text, got.num_output_tokens) == ([1, 2, 3], "<1><2><3>", 3)
        box.put(delta(4))
        assert (await box.get()).text == "<4>"
        box.put(delta(5))
        box.put(delta(6, finished=True))
        box.put(delta(7))  # (never after a final one; kept out anyway)
        got = await box.get()
        assert (got.output_token_ids, got.text, got.finished) == ([5, 6], "<5><6>", True)

    asyncio.run(main())


def test_a_burst_is_refused_before_it_is_tokenized(engine):
    """Requests waiting to be tokenized count against the server's bound: a burst beyond it
    gets 503s at once instead of all being tokenized (holding the interpreter) and then
    refused."""
    from concurrent.futures import ThreadPoolExecutor

    api = APIServer(engine, ServerConfig(engine=engine.config, max_pending=1))  # 2 in flight
    url, stop = _serve_in_thread(api)
    tokenized = []
    tokenize = engine.tokenize
    engine.tokenize = lambda *a, **k: tokenized.append(1) or time.sleep(0.2) or tokenize(*a, **k)
    body = {"prompt": "hello there", "max_tokens": 2, "temperature": 0}
    try:
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body,
                                                       timeout=30).status_code, range(12)))
    finally:
        engine.tokenize = tokenize
        stop()
    assert codes.count(503) >= 8 and set(codes) <= {200, 503}, codes
    assert len(tokenized) == codes.count(200), (len(tokenized), codes)


def test_an_unexpected_error_answers_500_with_an_id_the_log_has(engine, caplog):
    """A bug in a handler answers 500 naming an id that the server's log holds with the
    exception, not the exception's text (paths, internals) in the response."""
    api = APIServer(engine, ServerConfig(engine=engine.config))
    url, stop = _serve_in_thread(api)

    def tokenize(*args, **kwargs):
        raise RuntimeError("secret detail at /srv/models/private")

    engine.tokenize = tokenize
    try:
        with caplog.at_level(logging.ERROR, logger="lmkv_engines.minimal.api_server"):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert "secret" not in message and "RuntimeError" not in message
        error_id = message.split("(id ")[1].split(":")[0]
        assert any(error_id in rec.getMessage() and "secret detail" in rec.getMessage()
                   for rec in caplog.records)
    finally:
        del engine.tokenize
        stop()


def test_lmkv_is_not_closed_under_a_step_the_stop_did_not_end(engine, caplog):
    """The stop waits for the engine thread 30 s; serve then closed lmkv (its I/O worker,
    hot cache, connector) even while a long step still used it. A step still running is
    said, and lmkv left as it is. (Found by a review.)"""
    from lmkv_engines.minimal.api_server import close_engine

    started, release = threading.Event(), threading.Event()
    real = engine.step

    def slow_step():
        started.set()
        release.wait(10)
        return real()

    engine.step = slow_step
    closed = []
    engine.close = lambda: closed.append(True)

    async def main():
        ae = AsyncEngine(engine, max_in_flight=2)
        ae.start()
        outputs = ae.generate("a", [5, 6, 7], GREEDY)
        task = asyncio.ensure_future(anext(outputs))
        assert await asyncio.to_thread(started.wait, 5)
        ae.shutdown(timeout=0.1)
        assert ae.in_step  # still in its step
        with caplog.at_level(logging.ERROR):
            assert not close_engine(engine, ae)
        assert not closed and "still in a step" in caplog.text
        release.set()
        ae.shutdown(timeout=5)
        assert not ae.in_step and close_engine(engine, ae) and closed
        with pytest.raises(EngineError):
            await task

    asyncio.run(main())


def test_a_request_is_announced_when_taken_and_frees_its_place_when_finished(engine):
    """With ``announce`` a request says at once that the engine took it (or raises its
    refusal), though its first token waits for a place to run; a finished request frees
    its place in max_in_flight though its reader still holds the iterator."""

    async def main():
        ae = AsyncEngine(engine, max_in_flight=3)
        ae.start()
        try:
            first = ae.generate("a", [5, 6, 7], LONG)
            assert (await anext(first)).output_token_ids
            second = ae.generate("b", [8, 9], GREEDY, announce=True)  # max_num_seqs=1: waits
            assert await asyncio.wait_for(anext(second), 5) is None
            assert len(engine.scheduler.waiting) == 1 and ae.num_in_flight == 2
            with pytest.raises(ValueError, match="empty"):
                await anext(ae.generate("c", [], GREEDY, announce=True))
            await first.aclose()
            out = await asyncio.wait_for(anext(second), 30)
            while not out.finished:
                out = await asyncio.wait_for(anext(second), 30)
            assert ae.num_in_flight == 0  # the reader has not let go of "b" yet
            third = ae.generate("d", [1], GREEDY)
            assert (await _last(third)).finished and ae.num_in_flight == 0
            await second.aclose()
            assert ae.num_in_flight == 0
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_a_streamed_batch_starts_before_every_prompt_has_a_place_and_a_full_one_is_one_503(engine):
    """Several prompts, more than max_num_seqs: the stream starts once the engine took them
    all, not once each has its first token (the first waits for the others to finish). A
    batch that does not fit the server's bound is one refusal, and nothing reaches the
    engine."""
    api = APIServer(engine, ServerConfig(engine=engine.config, max_pending=2))  # 3 in flight
    url, stop = _serve_in_thread(api)
    real_step = engine.step
    engine.step = lambda: time.sleep(0.005) or real_step()
    body = {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.metrics.waiting._value.get() == 1  # the second prompt's turn is to come
            prompts = engine.metrics.prompt_tokens._value
            before = prompts.get()
            three = {"prompt": [[5], [6], [7]], "max_tokens": 2}
            busy = httpx.post(f"{url}/v1/completions", json=three)
            assert busy.status_code == 503 and "capacity" in busy.json()["error"]["message"]
            time.sleep(0.3)
            assert prompts.get() == before  # refused before any prompt was handed on
        text = httpx.get(f"{url}/metrics").text
        assert "api_generations_rejected_total 1.0" in text
    finally:
        engine.step = real_step
        stop()


def test_clients_that_come_and_go_during_a_long_step_leave_no_commands(engine):
    """While one step runs long, clients keep arriving and leaving: a request that never
    reached the engine is dropped from the queue of commands, not followed by an abort
    (each left two commands, one holding its prompt, while its place was free again)."""
    release = threading.Event()
    real_step = engine.step

    def slow_step():
        release.wait(30)
        return real_step()

    async def main():
        ae = AsyncEngine(engine, max_in_flight=4)
        ae.start()
        try:
            first = ae.generate("a", [5, 6, 7], GREEDY)
            task = asyncio.ensure_future(_last(first))
            await asyncio.sleep(0.2)  # "a" is in its long step
            for i in range(300):
                outputs = ae.generate(f"x{i}", [1] * 200, GREEDY)
                pending = asyncio.ensure_future(anext(outputs))
                await asyncio.sleep(0)
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
            assert len(ae._commands) <= ae.max_in_flight and ae.num_in_flight == 1
            release.set()
            assert (await asyncio.wait_for(task, 30)).finished
        finally:
            release.set()
            ae.shutdown()

    engine.step = slow_step
    try:
        asyncio.run(main())
    finally:
        engine.step = real_step
    assert not engine.has_unfinished_requests() and not engine.requests


def test_a_step_failure_that_leaves_the_device_unusable_stops_the_engine(engine, caplog):
    """A sticky CUDA error (an illegal address, an ECC error) fails every later step too:
    the engine stops, saying so, and /health answers 503 (it answered 200 while every
    request got a 500, so no supervisor restarted the process)."""
    real_lost = engine.device_lost
    engine.device_lost = lambda: RuntimeError("CUDA error: an illegal memory access was encountered")

    async def main():
        ae = AsyncEngine(engine, max_in_flight=8)
        ae.start()
        try:
            _fail_next_step(engine)
            with pytest.raises(EngineError):
                await _last(ae.generate("a", [5, 6, 7], GREEDY))
            deadline = time.monotonic() + 10
            while ae.is_alive:
                assert time.monotonic() < deadline, "the engine went on"
                await asyncio.sleep(0.05)
        finally:
            ae.shutdown()

    try:
        with caplog.at_level(logging.ERROR):
            asyncio.run(main())
    finally:
        engine.device_lost = real_lost
    assert "CUDA device is unusable" in caplog.text and "restart the process" in caplog.text
    assert engine.device_lost() is None  # a CPU engine's device is never lost
