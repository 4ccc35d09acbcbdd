"""Run with .venv-lmcache's python: LMCache 0.5.6's own LMCServerConnector against a server.

    python lmcache_client.py PORT [MODEL_NAME]

Puts one KV chunk tensor and reads it back through the reference client, then prints one
JSON line: {"exists_before", "exists_after", "equal", "shape", "dtype", "fmt"}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNK = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 8  # chunk tensor [2, L, T, H*D] = [2, 2, 16, 16] bf16


def main() -> None:
    port = int(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "interop-model"
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, remote_url=None
    )
    metadata = LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )
    cpu_backend = LocalCPUBackend(config, metadata)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    connector = LMCServerConnector("127.0.0.1", port, loop, cpu_backend)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    key = CacheEngineKey(model, 1, 0, -0x1A2B3C4D5E6F7081, torch.bfloat16)
    shape = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD_DIM])
    obj = cpu_backend.allocate(shape, torch.bfloat16)
    torch.manual_seed(0)
    obj.tensor.copy_(torch.randn(shape, dtype=torch.bfloat16))
    expected = obj.tensor.clone()

    exists_before = run(connector.exists(key))
    run(connector.put(key, obj))
    exists_after = run(connector.exists(key))
    got = run(connector.get(key))
    result = {
        "exists_before": exists_before,
        "exists_after": exists_after,
        "equal": got is not None and torch.equal(got.tensor.view(shape), expected),
        "shape": list(got.meta.shape) if got is not None else None,
        "dtype": str(got.meta.dtype) if got is not None else None,
        "fmt": int(got.meta.fmt.value) if got is not None else None,
    }
    run(connector.close())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
