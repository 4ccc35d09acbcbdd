"""The I/O worker's three queues: urgent before soon before background, and what a long job
lets run between its batches."""

from __future__ import annotations

import threading

from lmkv.storage.io import IOWorker


def test_urgent_jobs_run_before_soon_ones_and_soon_ones_before_background_work():
    io = IOWorker(16)
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []
    io.submit(lambda: (started.set(), gate.wait()))
    assert started.wait(5)  # the worker is busy before the rest is queued
    try:
        io.submit(lambda: order.append("save"))
        io.submit(lambda: order.append("bring up 1"), soon=True)
        io.submit(lambda: order.append("fetch"), urgent=True)
        io.submit(lambda: order.append("bring up 2"), soon=True)
    finally:
        gate.set()
    assert io.drain(5)
    assert order == ["fetch", "bring up 1", "bring up 2", "save"]
    io.close()


def test_a_background_job_lets_soon_jobs_run_between_its_batches_and_a_soon_job_only_urgent_ones():
    """One level deep each: a soon job never runs inside another soon job (they keep their
    order, and the stack stays shallow however many are queued)."""
    io = IOWorker(16)
    order: list[str] = []

    def job(name: str, soon: bool, then=()):
        def run():
            order.append(f"{name} batch 1")
            for fn, kind in then:  # queued while it runs
                io.submit(fn, **{kind: True})
            io.run_urgent(soon=soon)
            order.append(f"{name} batch 2")
        return run

    fetch = lambda name: lambda: order.append(name)  # noqa: E731
    second = job("second bring up", soon=False)
    first = job("bring up", soon=False, then=[(second, "soon"), (fetch("fetch 2"), "urgent")])
    io.submit(job("prefetch", soon=True, then=[(first, "soon"), (fetch("fetch"), "urgent")]))
    assert io.drain(5)
    assert order == ["prefetch batch 1", "fetch", "bring up batch 1", "fetch 2", "bring up batch 2",
                     "second bring up batch 1", "second bring up batch 2", "prefetch batch 2"]
    io.close()
