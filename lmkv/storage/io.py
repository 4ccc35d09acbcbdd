"""The one background I/O worker of a process: lower-tier reads and writes run here.

Three queues: urgent work (a load the scheduler is waiting for) runs first, then soon work
(chunks read up for a request the engine keeps waiting for them), then background work
(saves, prefetches). Urgent work also runs between the batches of a long soon or
background job, and soon work between those of a background job (one level deep each:
soon jobs never run inside each other, so they run in the order they came). Background
work is bounded: when the queue is full it is dropped (a lost save or prefetch costs a
recompute later, never a stall of the engine).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

from ..logs import LogThrottle

log = logging.getLogger(__name__)


class IOWorker:
    def __init__(self, max_background: int, name: str = "lmkv-io"):
        self._urgent: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._soon: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._background: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue(max_background)
        self._wake = threading.Semaphore(0)
        self._lock = threading.Lock()  # submit vs close: nothing is queued after the stop
        self._closed = False
        self._stalled: Future | None = None  # the no-op of the last drain that timed out
        self._quiet = LogThrottle()  # a failure that lasts fails every job: told once a minute
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], urgent: bool = False, soon: bool = False) -> Future | None:
        """Queue ``fn`` (urgent, soon, or else background); returns its future, or None if
        background work was dropped. RuntimeError once the worker is closed."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("I/O worker is closed")
            if urgent:
                self._urgent.put((fn, fut))
            elif soon:
                self._soon.put((fn, fut))
            else:
                try:
                    self._background.put_nowait((fn, fut))
                except queue.Full:
                    return None
            self._wake.release()
        return fut

    def pending(self) -> int:
        return self._urgent.qsize() + self._soon.qsize() + self._background.qsize()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has run (at once once closed: close runs it);
        False if that took longer than ``timeout`` seconds. Until the no-op of a drain that
        timed out has run (the worker is stuck on a job, or far behind), False at once and
        nothing queued: each caller would wait the whole timeout again, each behind one
        more queued no-op."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
        if self._closed:
            return True
        stalled = self._stalled
        if stalled is not None and not stalled.done():
            return False
        fut = self.submit(lambda: None, urgent=False)
        while fut is None:  # queue full: wait for room
            if left() == 0.0:
                return False
            threading.Event().wait(0.01)
            fut = self.submit(lambda: None, urgent=False)
        try:
            fut.result(left())
        except FuturesTimeout:
            self._stalled = fut
            return False
        return True

    def close(self, timeout: float = 30.0) -> bool:
        """Run everything queued (each job releases what it holds), then stop; False (and
        an error logged) if the worker has not stopped within ``timeout`` seconds (a job is
        stuck: the thread is left behind, a daemon)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        try:  # behind every queued job (waits for room if full)
            self._background.put(None, timeout=timeout)
        except queue.Full:
            log.error("lmkv: the I/O worker did not stop: a job has run for over %.0f s", timeout)
            return False
        self._wake.release()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.error("lmkv: the I/O worker did not stop within %.0f s: a job is stuck "
                      "(%d left queued)", timeout, self.pending())
            return False
        return True

    def run_urgent(self, soon: bool = False) -> None:
        """Inside a long job (on the worker's thread): run the urgent jobs queued now, and
        with ``soon`` (from a background job) the soon ones too, so that a load the engine
        waits for goes ahead of the rest of a prefetch."""
        if threading.current_thread() is not self._thread:
            return
        queues = (self._urgent, self._soon) if soon else (self._urgent,)
        while (item := _take(queues)) is not _EMPTY:
            self._wake.acquire(blocking=False)  # its wake-up (if already given; _run copes)
            self._execute(item, urgent=True)

    def _run(self) -> None:
        while True:
            self._wake.acquire()
            urgent = True
            item = _take((self._urgent, self._soon))
            if item is _EMPTY:
                item, urgent = _take((self._background,)), False
                if item is _EMPTY:
                    continue  # the wake-up of a job that run_urgent ran
            if item is None:
                return
            self._execute(item, urgent)

    def _execute(self, item: tuple[Callable[[], Any], Future], urgent: bool) -> None:
        fn, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # reported through the future
            fut.set_exception(e)
            if not urgent:  # nobody waits for a background job's future
                self._quiet.log(log, logging.ERROR, "job", "lmkv: a background I/O job failed: %r",
                                e, exc_info=True)


_EMPTY = object()


def _take(queues):
    """The first item of the first non-empty queue, or _EMPTY."""
    for q in queues:
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
    return _EMPTY
