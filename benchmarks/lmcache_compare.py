"""lmkv vs LMCache 0.5.6 on the same storage work, in one run: store and retrieve GB/s.

The same paged CPU KV buffer [L, 2, blocks, 16, H, D] (block table shuffled), the same
prompts (4096 tokens, chunks of 256), fp16 and fp32. Each side stores the prompt's chunks
from paged memory into its tier and retrieves them into other blocks of paged memory:
- lmkv: LMKVCache (hot CPU tier; disk tier) with lmkv.ops paged_to_chunk / chunk_to_paged;
- LMCache: LMCacheEngine (local_cpu; local_disk with local_cpu off, by default and with its
  O_DIRECT option), driven by benchmarks/lmcache_side.py in LMCache's venv (.venv-lmcache)
  as a subprocess, with a CPU connector (LMCache's need a GPU) that copies either with torch,
  block by block, or with lmkv's native copier. Lines compare lmkv with LMCache's fastest
  setup on each tier (connector, and on disk its O_DIRECT setting too).
A store counts until the chunks are in the tier (disk: written). Disk retrieves start with
the tier's files dropped from the page cache, on both sides. The sides take --rounds turns,
alternating; each figure is the best of --repeats in every round; each retrieve is checked
against the source blocks. Lines end with the ratio
lmkv/LMCache. Targets: hot retrieve >= 2x LMCache and >= 0.5x memcpy (the fastest copy of
the same bytes into pre-faulted memory we know, lmkv_ttft.memcpy_gbps, best of runs before
and after both sides); disk
retrieve >= 1.2x LMCache. A line compares both sides' disk retrieves with the fastest plain
cold read of lmkv's files that we know (as many bytes of KV a second: benchmarks/common.py's
raw_read_seconds): a reference, not a bound, where the disk's speed moves between reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_kv_work_args, check_kv_work_args, drop_page_cache, random_prompt, raw_read_seconds  # noqa: E402
from lmkv_ttft import memcpy_gbps  # noqa: E402

from lmkv import ops  # noqa: E402
from lmkv.cache import LMKVCache  # noqa: E402
from lmkv.config import load_config  # noqa: E402
from lmkv.layout import KVLayout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
BLOCK = 16
DTYPES = {"float16": torch.float16, "float32": torch.float32}


def make_work(root: Path, args, dtype: str) -> tuple[torch.Tensor, dict]:
    """The shared work, written to ``root`` for LMCache's side: paged memory with room for
    two copies of the prompt, source and destination slots on shuffled blocks, prompts."""
    n = args.tokens
    blocks = 2 * n // BLOCK + 8
    g = torch.Generator().manual_seed(0)
    paged = torch.randn(args.layers, 2, blocks, BLOCK, args.heads, args.head_dim, generator=g)
    paged = paged.to(DTYPES[dtype])
    order = torch.randperm(blocks, generator=g)
    src_blocks, dst_blocks = order[: n // BLOCK], order[n // BLOCK : 2 * n // BLOCK]
    offsets = torch.arange(BLOCK)

    def slots(b: torch.Tensor) -> list[int]:
        return (b[:, None] * BLOCK + offsets).flatten().tolist()

    meta = dict(
        dtype=dtype, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
        chunk=args.chunk, repeats=args.repeats, kv_bytes=n * paged[:, :, 0, 0].numel() * paged.element_size(),
        paged_shape=list(paged.shape), paged_numel=paged.numel(),
        src_slots=slots(src_blocks), dst_slots=slots(dst_blocks),
        prompts=[random_prompt(n, 32000, seed=100 + i) for i in range(args.repeats)],
    )
    paged.flatten().numpy().tofile(root / "paged.bin")
    (root / "meta.json").write_text(json.dumps(meta))
    return paged, meta


def lmkv_side(root: Path, paged: torch.Tensor, meta: dict) -> dict[str, list[float]]:
    layout = KVLayout(meta["layers"], meta["heads"], meta["head_dim"], paged.dtype, meta["chunk"])
    src, dst = (torch.tensor(meta[k]) for k in ("src_slots", "dst_slots"))
    chunk = meta["chunk"]
    src_chunks = [src[i : i + chunk] for i in range(0, len(src), chunk)]
    dst_chunks = [dst[i : i + chunk] for i in range(0, len(dst), chunk)]
    src_blocks, dst_blocks = src[::BLOCK] // BLOCK, dst[::BLOCK] // BLOCK
    gb = 1.5 * meta["repeats"] * meta["kv_bytes"] / 2**30 + 0.25
    out: dict[str, list[float]] = {}
    for tier in ("cpu", "disk"):
        disk = root / "lmkv-disk"
        extra = dict(local_disk=str(disk), max_local_disk_size=gb) if tier == "disk" else {}
        engine = LMKVCache(load_config(env={}, chunk_size=chunk, max_local_cpu_size=gb, **extra),
                            layout, "bench")
        stores, retrieves = [], []
        for tokens in meta["prompts"]:  # a fresh prompt per store: nothing is stored twice
            start = time.perf_counter()
            for key, slots in zip(engine.keys(tokens), src_chunks, strict=True):
                buf = engine.allocate()
                ops.paged_to_chunk(paged, slots, buf.kv)
                engine.store(key, buf)
                buf.release()
            engine.drain()
            stores.append(time.perf_counter() - start)
        files = sorted(p for p in disk.glob("*") if p.is_file()) if tier == "disk" else []
        for _ in meta["prompts"]:
            paged[:, :, dst_blocks] = 0
            if tier == "disk":
                engine.storage.hot.clear()
                drop_page_cache(files)
            start = time.perf_counter()
            bufs = engine.fetch(engine.keys(meta["prompts"][-1]))
            for buf, slots in zip(bufs, dst_chunks, strict=True):
                ops.chunk_to_paged(buf.kv, paged, slots)
                buf.release()
            retrieves.append(time.perf_counter() - start)
            assert len(bufs) == len(dst_chunks), f"{tier}: fetched {len(bufs)} chunks"
            assert torch.equal(paged[:, :, dst_blocks], paged[:, :, src_blocks]), tier
        out[f"{tier}_store"], out[f"{tier}_retrieve"] = stores, retrieves
        if tier == "disk":  # the same files read cold by the fastest plain reads we know
            out["raw_read"] = [raw_read_seconds(files)[0] * meta["kv_bytes"] / sum(
                f.stat().st_size for f in files)]  # per KV byte, as the retrieves count
        engine.close()
        shutil.rmtree(root / "lmkv-disk", ignore_errors=True)  # the next round stores afresh
    return out


def lmcache_side(root: Path) -> dict[str, list[float]]:
    res = subprocess.run([str(LMCACHE_PYTHON), str(Path(__file__).with_name("lmcache_side.py")),
                          "--data", str(root)], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"LMCache side failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kv_work_args(ap, BLOCK)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="turns each side takes, alternating")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"], choices=list(DTYPES))
    args = ap.parse_args()
    check_kv_work_args(ap, args)
    print(f"{args.tokens} tokens, chunk {args.chunk}, {args.layers} layers x {args.heads} KV heads "
          f"x {args.head_dim}, paged blocks of {BLOCK} (shuffled), best of {args.repeats} x "
          f"{args.rounds} rounds (the sides alternating); "
          f"torch threads {torch.get_num_threads()}")
    targets = []
    for dtype in args.dtypes:
        with tempfile.TemporaryDirectory(prefix="lmkv-vs-lmcache-") as tmp:
            root = Path(tmp)
            paged, meta = make_work(root, args, dtype)
            nbytes = meta["kv_bytes"]
            memcpy = memcpy_gbps(nbytes)  # best of before and after both sides: a ceiling
            theirs: dict[str, list[float]] = {}
            ours: dict[str, list[float]] = {}
            for _ in range(args.rounds):  # the sides take turns: a noisy spell hits both
                for key, value in lmcache_side(root).items():
                    theirs.setdefault(key, []).extend(value)
                for key, value in lmkv_side(root, paged, meta).items():
                    ours.setdefault(key, []).extend(value)
            memcpy = max(memcpy, memcpy_gbps(nbytes))
        for tier, what in (("cpu", "store"), ("cpu", "retrieve"), ("disk", "store"), ("disk", "retrieve")):
            key = f"{tier}_{what}"
            a = nbytes / min(ours[key]) / 1e9
            # LMCache at its best: either connector; on disk also either setting
            setups = [(t, c) for t in ((tier,) if tier == "cpu" else ("disk", "disk_direct"))
                      for c in ("", "_native")]
            rates = {s: nbytes / min(theirs[f"{s[0]}{s[1]}_{what}"]) / 1e9 for s in setups}
            names = {"cpu": "", "disk": "default, ", "disk_direct": "use_odirect, "}
            print(f"{dtype} {nbytes / 1e6:.0f} MB, {tier} tier {what}: LMCache " + ", ".join(
                f"{rate:.2f} GB/s ({names[t]}{'native' if c else 'torch'} copies)"
                for (t, c), rate in rates.items()))
            b = max(rates.values())
            print(f"{dtype} {nbytes / 1e6:.0f} MB, {tier} tier {what}: lmkv {a:.2f} GB/s vs "
                  f"LMCache {b:.2f} GB/s: lmkv/LMCache = {a / b:.2f}x")
            if what == "retrieve":
                goal = 2.0 if tier == "cpu" else 1.2
                targets.append((f"{dtype} {tier} retrieve lmkv/LMCache", a / b, goal))
            if key == "cpu_retrieve":
                print(f"{dtype} {nbytes / 1e6:.0f} MB, cpu tier retrieve: lmkv {a:.2f} GB/s vs memcpy "
                      f"{memcpy:.2f} GB/s: lmkv/memcpy = {a / memcpy:.2f}x")
                targets.append((f"{dtype} cpu retrieve lmkv/memcpy", a / memcpy, 0.5))
            if key == "disk_retrieve":
                raw = nbytes / min(ours["raw_read"]) / 1e9
                print(f"{dtype} {nbytes / 1e6:.0f} MB, disk tier retrieve vs the raw cold read of "
                      f"the files ({raw:.2f} GB/s): lmkv {a / raw:.2f}x, LMCache {b / raw:.2f}x: "
                      f"raw/LMCache = {raw / b:.2f}x")
    for name, ratio, goal in targets:
        print(f"target {name} >= {goal}x: {ratio:.3f}x {'met' if ratio >= goal else 'NOT met'}")


if __name__ == "__main__":
    main()
