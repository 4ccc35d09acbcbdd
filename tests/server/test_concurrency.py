"""32 clients at once: no errors, and nothing acknowledged goes missing under the cap."""

from __future__ import annotations

import os
import random
import threading
import time

from lmkv.backends.lm import LMBackend

CLIENTS = 32


def test_32_clients_mixed_put_get(spawn_server):
    server = spawn_server("--max-memory", "256MiB")
    stop = time.monotonic() + 3
    errors: list[BaseException] = []
    rounds: list[int] = []

    def client(n: int):
        rng = random.Random(n)
        backend = LMBackend(server.url, timeout=10)
        latest: dict[str, bytes] = {}
        i = 0
        try:
            while time.monotonic() < stop:
                key = f"c@{n}@{rng.randrange(8)}"
                if rng.random() < 0.5 or key not in latest:
                    value = os.urandom(rng.randrange(1, 300_000))
                    backend.put([(key, value)])
                    latest[key] = value
                else:
                    # any PUT before this GET on the same connection is applied: the
                    # GET is the acknowledgement, and it must see the last write
                    assert backend.get([key]) == [latest[key]], key
                i += 1
            keys = list(latest)
            assert backend.get(keys) == [latest[k] for k in keys]
            rounds.append(i)
        except BaseException as exc:  # collected, re-raised in the test thread
            errors.append(exc)
        finally:
            backend.close()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(rounds) == CLIENTS and min(rounds) > 0
    # the server sees each client's close when its connection thread next reads (EOF):
    # give a loaded machine a moment, but every connection must be gone
    deadline = time.monotonic() + 10
    while (stats := server.stats())["traffic"]["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["evictions"] == 0 and stats["traffic"]["connections"] == 0
    assert sum(stats["traffic"]["dropped"].values()) == 0
