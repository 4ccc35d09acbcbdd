"""LMCache 0.5.6's side of benchmarks/lmcache_compare.py, run in LMCache's own venv.

Reads the shared work from --data (a paged CPU KV buffer, block tables, prompts), stores
and retrieves it through LMCache's LMCacheEngine (CPU tier, then disk tier as configured by
default, then disk tier with its O_DIRECT option, extra_config use_odirect) and prints one
JSON object of seconds. LMCache's connectors need a GPU, so the engine gets a CPU
connector, in two versions, each tier run with both: PagedCPUConnector copies between the
paged buffer and LMCache's memory objects one block at a time with torch, as lmkv's torch
path does; NativePagedCPUConnector with lmkv's native copier, as lmkv's default path does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lmkv.transfer from this checkout
from common import drop_page_cache  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

from lmkv import transfer

DTYPES = {"float16": torch.float16, "float32": torch.float32}


class PagedCPUConnector(GPUConnectorInterface):
    """Copies between paged memory [L, 2, blocks, block_size, H, D] and memory objects in
    LMCache's KV_2LTD format [2, L, T, H * D]; kwargs carry slot_mapping (one slot per token)."""

    def __init__(self, paged: torch.Tensor):
        self.paged = paged
        self.layers, _, _, self.block_size, self.heads, self.head_dim = paged.shape

    def _pairs(self, memory_obj, start: int, end: int, slot_mapping: torch.Tensor):
        # [2, L, T, H, D] view of the object; tokens [start, end) cover whole blocks
        obj = memory_obj.tensor.view(2, self.layers, end - start, self.heads, self.head_dim)
        bs = self.block_size
        for i, slot in enumerate(slot_mapping[start:end:bs].tolist()):
            yield obj[:, :, i * bs : (i + 1) * bs], self.paged[:, :, slot // bs].transpose(0, 1)

    def from_gpu(self, memory_obj, start, end, **kwargs):
        for mine, page in self._pairs(memory_obj, start, end, kwargs["slot_mapping"]):
            mine.copy_(page)

    def to_gpu(self, memory_obj, start, end, **kwargs):
        for mine, page in self._pairs(memory_obj, start, end, kwargs["slot_mapping"]):
            page.copy_(mine)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.heads * self.head_dim])


class NativePagedCPUConnector(PagedCPUConnector):
    """The same copies with lmkv's native paged copier (lmkv.transfer, imported from this
    checkout: it needs only torch), called as lmkv's side calls it."""

    def _copy(self, memory_obj, start: int, end: int, slot_mapping: torch.Tensor, to_paged: bool) -> None:
        obj = memory_obj.tensor.view(2, self.layers, end - start, self.heads, self.head_dim)
        assert transfer.copy(self.paged, slot_mapping[start:end], obj, 0, to_paged), "not native"

    def from_gpu(self, memory_obj, start, end, **kwargs):
        self._copy(memory_obj, start, end, kwargs["slot_mapping"], to_paged=False)

    def to_gpu(self, memory_obj, start, end, **kwargs):
        self._copy(memory_obj, start, end, kwargs["slot_mapping"], to_paged=True)


def drop_tier_from_page_cache(root: Path) -> None:
    drop_page_cache([p for p in root.rglob("*") if p.is_file()])


def build(name: str, meta: dict, connector: PagedCPUConnector, disk: Path | None, direct: bool):
    layers, heads, head_dim = meta["layers"], meta["heads"], meta["head_dim"]
    gb = 1.5 * meta["repeats"] * meta["kv_bytes"] / 2**30 + 0.25
    if disk is None:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=meta["chunk"], local_cpu=True, max_local_cpu_size=gb)
    else:  # the CPU tier only lends its allocator: objects live on disk
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=meta["chunk"], local_cpu=False, max_local_cpu_size=gb,
            local_disk=f"file://{disk}", max_local_disk_size=gb,
            extra_config={"use_odirect": True} if direct else None)
    metadata = LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=DTYPES[meta["dtype"]], kv_shape=(layers, 2, meta["chunk"], heads, head_dim),
        chunk_size=meta["chunk"])
    engine = LMCacheEngineBuilder.get_or_create(
        name, config, metadata, connector, lambda t, r: None, lambda o, r: o)
    engine.post_init()
    return engine


def wait_on_disk(engine, tokens: torch.Tensor) -> None:
    disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
    while not all(disk.contains(k) and not disk.exists_in_put_tasks(k) for k in keys):
        time.sleep(0.0005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, required=True)
    args = ap.parse_args()
    meta = json.loads((args.data / "meta.json").read_text())
    dtype = DTYPES[meta["dtype"]]
    paged = torch.from_file(str(args.data / "paged.bin"), size=meta["paged_numel"], dtype=dtype)
    paged = paged.view(*meta["paged_shape"]).clone()
    prompts = [torch.tensor(p, dtype=torch.long) for p in meta["prompts"]]
    src, dst = (torch.tensor(s, dtype=torch.long) for s in (meta["src_slots"], meta["dst_slots"]))
    bs = paged.shape[3]
    src_blocks, dst_blocks = src[::bs] // bs, dst[::bs] // bs
    connectors = {"": PagedCPUConnector(paged),
                  "_native": NativePagedCPUConnector(paged)}
    out: dict[str, list[float]] = {}

    for tier, suffix in itertools.product(("cpu", "disk", "disk_direct"), connectors):
        connector = connectors[suffix]
        disk = args.data / "lmcache-disk" if tier != "cpu" else None
        if disk is not None:
            disk.mkdir()
        engine = build(f"bench-{tier}{suffix}", meta, connector, disk, direct=tier == "disk_direct")
        stores, retrieves = [], []
        for tokens in prompts:  # a fresh prompt per store: nothing is stored twice
            start = time.perf_counter()
            engine.store(tokens, slot_mapping=src)
            if disk is not None:
                wait_on_disk(engine, tokens)
            stores.append(time.perf_counter() - start)
        for _ in prompts:
            paged[:, :, dst_blocks] = 0
            if disk is not None:
                drop_tier_from_page_cache(disk)
            start = time.perf_counter()
            hit = engine.retrieve(prompts[-1], slot_mapping=dst)
            retrieves.append(time.perf_counter() - start)
            assert int(hit.sum()) == len(prompts[-1]), f"{tier}: retrieved {int(hit.sum())} tokens"
            assert torch.equal(paged[:, :, dst_blocks], paged[:, :, src_blocks]), tier
        out[f"{tier}{suffix}_store"], out[f"{tier}{suffix}_retrieve"] = stores, retrieves
        LMCacheEngineBuilder.destroy(f"bench-{tier}{suffix}")
        if disk is not None:
            shutil.rmtree(disk)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # LMCache leaves non-daemon threads behind
