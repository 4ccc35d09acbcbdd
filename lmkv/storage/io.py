"""The one background I/O worker of a process: lower-tier reads and writes run here.

Two queues: urgent work (a load the scheduler is waiting for) runs before background work
(saves, prefetches). Background work is bounded: when the queue is full it is dropped
(a lost save or prefetch costs a recompute later, never a stall of the engine).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)


class IOWorker:
    def __init__(self, max_background: int, name: str = "lmkv-io"):
        self._urgent: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._background: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue(max_background)
        self._wake = threading.Semaphore(0)
        self._lock = threading.Lock()  # submit vs close: nothing is queued after the stop
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], urgent: bool = False) -> Future | None:
        """Queue ``fn``; returns its future, or None if background work was dropped.
        RuntimeError once the worker is closed."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("I/O worker is closed")
            if urgent:
                self._urgent.put((fn, fut))
            else:
                try:
                    self._background.put_nowait((fn, fut))
                except queue.Full:
                    return None
            self._wake.release()
        return fut

    def pending(self) -> int:
        return self._urgent.qsize() + self._background.qsize()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far has run (at once once closed: close runs it)."""
        if self._closed:
            return
        fut = self.submit(lambda: None, urgent=False)
        while fut is None:  # queue full: wait for room
            threading.Event().wait(0.01)
            fut = self.submit(lambda: None, urgent=False)
        fut.result(timeout)

    def close(self) -> None:
        """Run everything queued (each job releases what it holds), then stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:  # behind every queued job (waits for room if full)
            self._background.put(None, timeout=30)
        except queue.Full:  # the worker is stuck in a job: leave it (a daemon thread)
            log.error("lmkv: the I/O worker did not stop: a job has run for over 30 s")
            return
        self._wake.release()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            self._wake.acquire()
            try:
                item, urgent = self._urgent.get_nowait(), True
            except queue.Empty:
                item, urgent = self._background.get_nowait(), False
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported through the future
                fut.set_exception(e)
                if not urgent:  # nobody waits for a background job's future
                    log.error("lmkv: a background I/O job failed: %r", e, exc_info=e)
