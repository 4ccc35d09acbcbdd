"""Checks every storage backend must pass, shared by the per-backend test files."""

from __future__ import annotations

import os
import socket
import threading


def check_batched_reads(backend, outs: list[memoryview]) -> None:
    """get_into_many over hits and a miss, in order, into the caller's buffers (``outs``:
    three buffers of at least 8 KiB)."""
    a, b = os.urandom(1000), os.urandom(8192)
    backend.put([("batch-a", a), ("batch-b", b)])
    assert backend.get_into_many(["batch-a", "batch-none", "batch-b"], outs) == [1000, None, 8192]
    assert bytes(outs[0][:1000]) == a and bytes(outs[2][:8192]) == b
    assert backend.get_into_many(["batch-b"], outs[1:2]) == [8192]  # a batch of one
    assert bytes(outs[1][:8192]) == b
    # each value read is reported once, with its bytes already in place, before the return
    seen = []
    lengths = backend.get_into_many(["batch-b", "batch-none", "batch-a"], outs,
                                    lambda i, n: seen.append((i, n, bytes(outs[i][:n]))))
    assert lengths == [8192, None, 1000]
    assert sorted(seen) == [(0, 8192, b), (2, 1000, a)]


def silent_dns(monkeypatch, name: str) -> tuple[threading.Event, list[str]]:
    """``name`` resolves to 127.0.0.1 only once the returned event is set: until then its
    lookups wait, as on a DNS server that does not answer (numeric-only lookups answer at
    once, as the system resolver's do). Also returns the list of lookups of ``name`` made."""
    answer, asked, real = threading.Event(), [], socket.getaddrinfo

    def lookup(host, *args, **kwargs):
        if host == name and not kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            asked.append(host)
            answer.wait(30)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    from lmkv.backends import net

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(net, "_answers", {})  # (no answer kept from before)
    return answer, asked
