"""Remote tiers: lmkv's backend path vs the raw client, same bytes, same run.

- Redis: lmkv fetch (GET + frame check + copy into a chunk slot) GB/s vs raw redis-py GET
  of the same values (target >= 0.8x).
- Mooncake: lmkv fetch (one zero-copy batch_get_into registered slots + frame check) vs the
  raw client's one batch_get_into of the same keys into registered targets (target >= 0.8x).
Both sides batch the same way: one pipelined round trip (Redis), one batch call (Mooncake).
Starts its own redis-server and Mooncake master + storage process on loopback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmkv.backends.registry import create_backend  # noqa: E402
from lmkv.layout import KVLayout  # noqa: E402
from lmkv.memory import MemoryPool  # noqa: E402
from lmkv.metrics import LMKVMetrics  # noqa: E402
from lmkv.storage.manager import StorageManager, Tier  # noqa: E402
from tests.mooncake_store import MooncakeStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def fill(manager: StorageManager, n: int) -> list[str]:
    keys = []
    for i in range(n):
        buf = manager.allocate()
        buf.kv.copy_(torch.randn(buf.kv.shape))
        key = f"bench-{i}"
        manager.put(key, buf)
        buf.release()
        keys.append(key)
    manager.io.drain()
    return keys


def lmkv_fetch_seconds(manager: StorageManager, keys: list[str]) -> float:
    manager.hot.clear()
    start = time.perf_counter()
    bufs = manager.fetch(keys)
    elapsed = time.perf_counter() - start
    assert len(bufs) == len(keys)
    for b in bufs:
        b.release()
    return elapsed


def best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # 4 MiB chunks: 2 (K, V) x 8 layers x 256 tokens x 4 heads x 64 x fp32
    layout = KVLayout(8, 4, 64, torch.float32, 256)
    n = args.chunks
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-remote-bench-"))
    print(f"{n} chunks of {layout.chunk_bytes / 2**20:.1f} MiB")

    redis_server = RedisServer(tmp / "redis").start()
    try:
        import redis

        pool = MemoryPool(layout, (n + 4) * (layout.chunk_bytes + 64))
        manager = StorageManager(pool, [Tier("remote", create_backend(redis_server.url, 5.0))],
                                 LMKVMetrics())
        keys = fill(manager, n)
        raw = redis.Redis(port=redis_server.port)
        nbytes = sum(len(raw.get("lmkv:" + k)) for k in keys)

        def raw_get() -> float:  # one pipelined batch, as lmkv's backend sends
            start = time.perf_counter()
            pipe = raw.pipeline(transaction=False)
            for k in keys:
                pipe.get("lmkv:" + k)
            pipe.execute()
            return time.perf_counter() - start

        t_raw = best(raw_get, args.repeats)
        t_lmkv = best(lambda: lmkv_fetch_seconds(manager, keys), args.repeats)
        print(f"redis get: lmkv {nbytes / t_lmkv / 1e9:.2f} GB/s vs raw redis-py GET "
              f"{nbytes / t_raw / 1e9:.2f} GB/s: lmkv/raw = {t_raw / t_lmkv:.2f}x")
        manager.close()
    finally:
        redis_server.kill()

    if shutil.which("mooncake_master"):
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        store = MooncakeStore(tmp / "mooncake", segment="1 GB").start()
        try:
            from lmkv.backends.mooncake import MooncakeBackend

            pool = MemoryPool(layout, (n + 4) * (layout.chunk_bytes + 64))
            manager = StorageManager(pool, [Tier("remote", create_backend(store.url, 5.0))],
                                     LMKVMetrics())
            keys = fill(manager, n)
            raw = MooncakeBackend(store.url)
            # one pre-faulted, registered target per chunk, as lmkv's pool has
            targets = torch.zeros(n, layout.chunk_bytes + 64, dtype=torch.uint8)
            raw.register_memory(memoryview(targets.numpy()).cast("B"))
            addrs = [raw._registered(memoryview(t.numpy())) for t in targets]
            sizes = [raw.store.get_size(k) for k in keys]

            def raw_get_into() -> float:  # one batch, as lmkv's backend sends
                start = time.perf_counter()
                codes = raw.store.batch_get_into(keys, addrs, sizes)
                elapsed = time.perf_counter() - start
                assert list(codes) == sizes
                return elapsed

            nbytes = sum(sizes)
            t_raw = best(raw_get_into, args.repeats)
            t_lmkv = best(lambda: lmkv_fetch_seconds(manager, keys), args.repeats)
            print(f"mooncake get: lmkv {nbytes / t_lmkv / 1e9:.2f} GB/s vs raw batch_get_into "
                  f"{nbytes / t_raw / 1e9:.2f} GB/s (both one batch_get_into): lmkv/raw = "
                  f"{t_raw / t_lmkv:.2f}x")
            manager.close()
            raw.close()
        finally:
            store.kill()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
