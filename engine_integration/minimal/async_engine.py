"""AsyncEngine: the LLMEngine's step loop in one background thread, fed from asyncio.

Handlers call ``generate()`` on the event loop. Adds and aborts reach the engine thread
through a locked list of commands, applied between steps; outputs come back through one
mailbox per request, filled with ``loop.call_soon_threadsafe``, that keeps the newest
cumulative output or joins delta outputs, so a client that stops reading costs at most its
output so far, not one message per token generated. Only the engine thread touches the
LLMEngine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .outputs import RequestOutput
from .sampling_params import OutputKind, SamplingParams
from .server_metrics import ServerMetrics

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger(__name__)


class _Accepted:
    """The engine took the request (put before any of its outputs)."""


ACCEPTED = _Accepted()
# what the engine thread puts in a request's mailbox
_Item = RequestOutput | Exception | _Accepted


class _Mailbox:
    """What the engine thread has for one request that its reader has not taken yet, on the
    event loop. An output holding everything so far replaces an unread one; delta outputs
    (OutputKind.DELTA) are joined to the unread ones, so a reader that fell behind gets one
    output with all it missed. A final item (a finished output or an error) is never
    replaced."""

    def __init__(self, delta: bool = False) -> None:
        self._delta = delta
        self._item: _Item | None = None
        self._ids: list[int] = []  # unread deltas before _item: their token ids and texts
        self._texts: list[str] = []
        self._ready = asyncio.Event()

    def put(self, item: _Item) -> None:
        if isinstance(self._item, Exception) or (
                isinstance(self._item, RequestOutput) and self._item.finished):
            return
        if self._delta and isinstance(self._item, RequestOutput) and isinstance(item, RequestOutput):
            self._ids.extend(self._item.output_token_ids)
            self._texts.append(self._item.text)
        self._item = item
        self._ready.set()

    async def get(self) -> _Item:
        await self._ready.wait()
        self._ready.clear()
        item, self._item = self._item, None
        assert item is not None
        if self._texts and isinstance(item, RequestOutput):
            item = replace(item, output_token_ids=self._ids + item.output_token_ids,
                           text="".join(self._texts) + item.text)
        self._ids, self._texts = [], []
        return item


class QueueFullError(Exception):
    """Too many requests in flight; the client should retry later."""


class EngineError(Exception):
    """The engine failed this request (a step raised)."""


class EngineStoppedError(EngineError):
    """The engine is not running (shut down, or its thread died)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    queue: _Mailbox


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, max_in_flight: int, metrics: ServerMetrics | None = None
    ):
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.metrics = metrics
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []  # guarded by _cond
        self._closed = False  # guarded by _cond; set once the engine thread stops
        self._stopping = False  # guarded by _cond
        self._queues: dict[str, _Mailbox] = {}  # engine thread only
        self._in_flight = 0  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event loop side ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread. Call on the event loop that will call generate()."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the engine thread to stop (without waiting): unfinished requests fail with
        EngineStoppedError. Thread-safe."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (waiting ``timeout`` seconds at most: ``in_step`` says
        whether it still runs); unfinished requests fail with EngineError."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def in_step(self) -> bool:
        """Whether the engine thread still runs (a step that has not ended)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        with self._cond:
            closed = self._closed or self._stopping
        return not closed and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        announce: bool = False,
    ) -> AsyncIterator[RequestOutput | None]:
        """The outputs of one request (of ``params.output_kind``); the last one is finished.
        With ``announce``, None comes first, once the engine has taken the request.

        Raises ValueError when the engine refuses the request (the message says why),
        QueueFullError when ``max_in_flight`` requests are already in flight, EngineError
        when the engine fails (EngineStoppedError when it is not running). Closing the
        iterator before the end aborts the request. Its place in ``max_in_flight`` is free
        once its finished output is taken.
        """
        if not self.is_alive:
            raise EngineStoppedError("the engine is not running")
        if self._in_flight >= self.max_in_flight:
            if self.metrics:
                self.metrics.rejected.inc()
            raise QueueFullError(
                f"the server is at capacity ({self.max_in_flight} requests in flight); "
                "retry later"
            )
        queue = _Mailbox(delta=params.output_kind is OutputKind.DELTA)
        self._set_in_flight(self._in_flight + 1)
        done = False
        try:
            self._submit(_Add(request_id, prompt, params, queue))
            while not done:
                item = await queue.get()  # the newest: a consumer that fell behind skips ahead
                if isinstance(item, Exception):
                    done = True  # the engine thread has already dropped the request
                    raise item
                if announce:
                    announce = False
                    yield None
                if isinstance(item, _Accepted):
                    continue
                done = item.finished
                if done:  # (its reader may hold the iterator open for a while yet)
                    self._set_in_flight(self._in_flight - 1)
                yield item
        finally:
            if not done:
                self._set_in_flight(self._in_flight - 1)
                self._submit(_Abort(request_id))
            elif isinstance(item, Exception):
                self._set_in_flight(self._in_flight - 1)

    def _set_in_flight(self, n: int) -> None:
        self._in_flight = n
        if self.metrics:
            self.metrics.in_flight.set(n)

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if not self._closed:
                if isinstance(command, _Abort) and self._unqueue(command.request_id):
                    return  # it never reached the engine: nothing to abort
                self._commands.append(command)
                self._cond.notify()
                return
        if isinstance(command, _Add):  # the engine thread is gone: nobody else will answer
            command.queue.put(EngineStoppedError("the engine is not running"))

    def _unqueue(self, request_id: str) -> bool:
        """Drop the request's add if it is still queued (under _cond): clients that come and
        go during a long step leave nothing behind (each left an add and an abort, holding
        its prompt, though its place in max_in_flight was free again)."""
        for i, queued in enumerate(self._commands):
            if isinstance(queued, _Add) and queued.request_id == request_id:
                del self._commands[i]
                return True
        return False

    # ---- engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._commands or self._stopping or self.engine.has_unfinished_requests()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests() and not self._step():
                    break
        except BaseException:
            log.exception("the engine loop crashed")
        finally:
            self._close()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._queues.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except ValueError as e:
            self._post(command.queue, ValueError(str(e)))
        except Exception as e:
            log.exception("adding request %s failed", command.request_id)
            self._post(command.queue, EngineError(f"the engine could not add the request: {e}"))
        else:
            self._queues[command.request_id] = command.queue
            self._post(command.queue, ACCEPTED)

    def _step(self) -> bool:
        """One engine step; False when the engine is broken beyond recovery."""
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing its %d requests", len(self._queues))
            if self.metrics:
                self.metrics.step_errors.inc()
            lost = self.engine.device_lost()
            if lost is not None:  # every later step would fail too: stop (health says 503)
                log.error("the engine's CUDA device is unusable (%s); the engine stops: restart "
                          "the process", lost)
                self._fail_requests()
                return False
            return self._fail_requests()
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue  # aborted while the step ran
            self._post(queue, out)
            if out.finished:
                del self._queues[out.request_id]
        return True

    def _fail_requests(self) -> bool:
        """Fail and abort every request in the engine; True if that left it clean."""
        for queue in self._queues.values():
            self._post(queue, EngineError("the engine failed while running this request"))
        self._queues.clear()
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("aborting request %s after a failed step failed", request_id)
        if self.engine.has_unfinished_requests():
            log.error("the engine still holds requests after aborting all of them; stopping it")
            return False
        return True

    def _close(self) -> None:
        with self._cond:
            self._closed = True
            commands, self._commands = self._commands, []
        queues = [c.queue for c in commands if isinstance(c, _Add)] + list(self._queues.values())
        self._queues.clear()
        for queue in queues:
            self._post(queue, EngineStoppedError("the engine stopped: the server is shutting down"))

    def _post(self, queue: _Mailbox, item: _Item) -> None:
        assert self._loop is not None
        # RuntimeError: the event loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(queue.put, item)
