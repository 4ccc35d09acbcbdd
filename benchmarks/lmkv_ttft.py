"""lmkv TTFT and retrieve bandwidth on SmolLM2-135M-Instruct (or --model), side by side in
one run.

Prints, for a long prompt (default 4096 tokens):
- TTFT cold (no lmkv) vs warm from the hot cache (target >= 20x) and from disk in a fresh
  process (target >= 5x); the floor (KV bytes / measured bandwidth + computing the
  uncached tail) and warm / floor (target <= 2x).
- hot-tier retrieve GB/s / memcpy GB/s (the fastest copy we know, ``memcpy_gbps``; target
  >= 0.5); disk-tier retrieve GB/s / the best raw read of the same files
  (``raw_read_seconds``: serial, advised and threaded, or O_DIRECT; target >= 0.7).
- zero-hit overhead: TTFT with lmkv on prompts that never hit / without lmkv (<= 1.05x).
Disk numbers are taken with the files dropped from the page cache (posix_fadvise).
With --device cuda the engine's pages are on the GPU: "memcpy" is then the copy of the same
bytes from pinned host memory to the device (the link), the hot retrieve's floor.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODEL_HELP,
    add_device_args,
    bench_model,
    best,
    drop_page_cache,
    random_prompt,
    raw_read_seconds,
    sync,
)

from lmkv import ops  # noqa: E402
from lmkv.config import load_config  # noqa: E402
from lmkv.paged import BlockPagedMemory  # noqa: E402
from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.sampling_params import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], FIRST_TOKEN)
    return time.perf_counter() - start


def tail_ttft(engine: LLM, prompt: list[int], hit: int) -> float:
    """TTFT with tokens [0, hit) in the engine's own prefix cache (it must have prefix
    caching on), computing the rest: the compute part of a load's floor. A hit one token
    short of the end (lmkv loads a prompt of whole chunks but for its last token) is not
    expressible in a block-granular prefix cache: then the whole prompt is cached and one
    more token is computed over it."""
    engine.engine.block_manager.reset_prefix_cache()
    if hit == len(prompt) - 1:
        engine.generate([prompt], FIRST_TOKEN)
        return ttft(engine, prompt + prompt[-1:])
    engine.generate([prompt[: hit + 1]], FIRST_TOKEN)
    return ttft(engine, prompt)


def engine_args(args) -> dict:
    return dict(kv_cache_memory=1 << 30, device=args.device, dtype=args.dtype,
                enforce_eager=args.enforce_eager)


def lmkv_llm(model_dir: Path, chunk: int, engine: dict, cpu_gb: float = 2.0, **lmkv) -> LLM:
    """The engine with lmkv (``lmkv``: more config keys) and no prefix cache of its own."""
    cfg = load_config(env={}, chunk_size=chunk, max_local_cpu_size=cpu_gb, **lmkv)
    return LLM(str(model_dir), lmkv_config=cfg, enable_prefix_caching=False, **engine)


def disk_llm(model_dir: Path, disk: Path, chunk: int, engine: dict, direct: bool = True,
             unfull: bool = False) -> LLM:
    return lmkv_llm(model_dir, chunk, engine, local_disk=str(disk), max_local_disk_size=4.0,
                    local_disk_direct=direct, save_unfull_chunk=unfull)


def link_gbps(nbytes: int, device: torch.device) -> float:
    """Pinned host memory to ``device``, one copy of ``nbytes``, best of 5: the host-device
    link, the floor of loading chunks from lmkv's (pinned) hot cache into GPU pages."""
    src = torch.ones(nbytes // 4, pin_memory=True)
    dst = torch.empty(nbytes // 4, device=device)

    def copy():
        dst.copy_(src, non_blocking=True)
        sync(device)

    return src.numel() * 4 / best(copy, 5) / 1e9


def memcpy_gbps(nbytes: int) -> float:
    """The fastest copy of ``nbytes`` between pre-faulted buffers that we know, best of 5:
    torch's copy_, or lmkv's native paged copy of the same bytes as two contiguous runs
    (streaming stores, torch's threads)."""
    rows = max(1, nbytes // (2 * 4096))  # rows of 4 KiB: a chunk [2, 1, rows, 1, 1024] float32
    src = torch.ones(2, 1, rows, 1, 1024)
    dst = torch.zeros(1, 2, rows, 1, 1, 1024)
    slots = torch.arange(rows)
    flat_src, flat_dst = src.view(-1), dst.view(-1)
    copies = [lambda: flat_dst.copy_(flat_src), lambda: ops.chunk_to_paged(src, dst, slots)]
    return src.numel() * 4 / min(best(copy, 5) for copy in copies) / 1e9


def child(args) -> None:
    """A fresh process: TTFT of the prompt with only the disk tier holding its chunks."""
    llm = disk_llm(args.model_dir, args.disk, args.chunk, engine_args(args), args.disk_direct,
                   args.save_unfull_chunk)
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompt(args.prompt_len, vocab, seed=0)
    ttft(llm, random_prompt(args.chunk - 1, vocab, seed=77))  # the process's first forward pass
    drop_page_cache(sorted(args.disk.glob("*.kv")))
    t = ttft(llm, prompt)
    out = llm.generate([prompt], FIRST_TOKEN)[0]
    print(json.dumps({"ttft": t, "external": out.num_external_tokens}))
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help=MODEL_HELP)
    add_device_args(ap)
    ap.add_argument("--disk-direct", action=argparse.BooleanOptionalAction, default=True,
                    help="the disk tier's O_DIRECT reads (config key local_disk_direct)")
    ap.add_argument("--save-unfull-chunk", action="store_true",
                    help="also store the prompt's partial last chunk (config key save_unfull_chunk)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--disk", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    model_dir = bench_model(args.model)
    n, reps = args.prompt_len, args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-bench-"))
    disk = tmp / "disk"

    engine = engine_args(args)
    plain = LLM(str(model_dir), enable_prefix_caching=False, **engine)
    llm = disk_llm(model_dir, disk, args.chunk, engine, args.disk_direct, args.save_unfull_chunk)
    device = llm.engine.device.torch
    lay = llm.engine.kv_connector.cache.layout
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompt(n, vocab, seed=0)
    fresh = [random_prompt(n, vocab, seed=1000 + i) for i in range(2 * reps + 1)]
    print(f"model {model_dir.name}, prompt {n} tokens, chunk {args.chunk}"
          f"{' (and the partial last one: save_unfull_chunk)' if args.save_unfull_chunk else ''}, "
          f"KV {lay.bytes_per_token * n / 1e6:.1f} MB "
          f"({lay.num_layers} layers, {lay.num_kv_heads} KV heads, {lay.dtype}); "
          f"engine on {device}; torch threads {torch.get_num_threads()}")

    # zero-hit overhead: alternate plain and lmkv on prompts never seen before
    ttft(plain, fresh[-1])
    ttft(llm, fresh[-1])
    cold, zero_hit = [], []
    for i in range(reps):
        cold.append(ttft(plain, fresh[2 * i]))
        zero_hit.append(ttft(llm, fresh[2 * i + 1]))
        llm.engine.kv_connector.cache.drain()  # its background writes not in the next plain run
    t_cold, t_zero = statistics.median(cold), statistics.median(zero_hit)

    # warm from the hot cache
    first = llm.generate([prompt], FIRST_TOKEN)[0]
    llm.engine.kv_connector.cache.drain()  # its disk writes (background) do not share the cores
    warm = [ttft(llm, prompt) for _ in range(reps)]
    out = llm.generate([prompt], FIRST_TOKEN)[0]
    hit = out.num_external_tokens
    assert out.output_token_ids == plain.generate([prompt], FIRST_TOKEN)[0].output_token_ids
    assert first.num_external_tokens == 0 and hit > 0
    t_hot = statistics.median(warm)

    # the floor's compute part: the uncached tail over a cached prefix (engine prefix cache),
    # its best run (a floor is the best case: the warm figures are medians)
    tail_engine = LLM(str(model_dir), **engine)
    t_tail = min(tail_ttft(tail_engine, prompt, hit) for _ in range(reps))
    tail_engine.close()
    kv_bytes = hit * lay.bytes_per_token
    on_gpu = device.type == "cuda"
    bw_mem = link_gbps(kv_bytes, device) if on_gpu else memcpy_gbps(kv_bytes)
    copy_name = "pinned->GPU copy" if on_gpu else "memcpy"
    floor_hot = kv_bytes / (bw_mem * 1e9) + t_tail

    # retrieve bandwidth, hot: fetch + scatter into paged memory vs memcpy
    lm = llm.engine.kv_connector.cache
    keys = lm.keys(prompt)[: -(-hit // args.chunk)]  # the chunks the hit loads from
    chunk_bytes = len(keys) * args.chunk * lay.bytes_per_token
    slots = [torch.arange(i * args.chunk, (i + 1) * args.chunk) for i in range(len(keys))]
    paged = BlockPagedMemory(llm.engine.kv_cache)

    def retrieve() -> float:
        start = time.perf_counter()
        bufs = lm.fetch(keys)
        for buf, s in zip(bufs, slots, strict=True):
            paged.load(buf.kv, s)
        sync(device)  # the chunks' memory is read until the copies finish
        for buf in bufs:
            buf.release()
        assert len(bufs) == len(keys)
        return time.perf_counter() - start

    t_ret_hot = min(retrieve() for _ in range(5))
    gb_hot = chunk_bytes / t_ret_hot / 1e9

    # retrieve bandwidth, disk: fetch from disk into the hot cache vs raw reads of the files
    lm.storage.io.drain()
    files = sorted(disk.glob("*.kv"))
    disk_times, raw_times = [], []
    for _ in range(3):
        lm.storage.hot.clear()
        drop_page_cache(files)
        start = time.perf_counter()
        bufs = lm.fetch(keys)
        disk_times.append(time.perf_counter() - start)
        assert len(bufs) == len(keys)
        for b in bufs:
            b.release()
        t_raw, raw_bytes = raw_read_seconds([lm.storage.tiers[0].backend.root /
                                             lm.storage.tiers[0].backend._name(k) for k in keys])
        raw_times.append(t_raw)
    t_ret_disk, t_raw = min(disk_times), min(raw_times)
    bw_disk = raw_bytes / t_raw / 1e9
    gb_disk = raw_bytes / t_ret_disk / 1e9
    llm.close()
    del llm

    # warm from disk in a fresh process
    res = subprocess.run(
        [sys.executable, __file__, "--child", "--disk", str(disk), "--model-dir", str(model_dir),
         "--prompt-len", str(n), "--chunk", str(args.chunk), "--device", args.device, "--dtype", args.dtype,
         *(["--enforce-eager"] if args.enforce_eager else []),
         "--disk-direct" if args.disk_direct else "--no-disk-direct",
         *(["--save-unfull-chunk"] if args.save_unfull_chunk else [])],
        capture_output=True, text=True, check=True,
    )
    child_out = json.loads(res.stdout.strip().splitlines()[-1])
    shutil.rmtree(tmp, ignore_errors=True)  # the disk tier's files (~1 GB)
    t_disk = child_out["ttft"]
    floor_disk = kv_bytes / (bw_disk * 1e9) + t_tail

    print(f"TTFT cold {t_cold * 1e3:.0f} ms vs warm hot cache {t_hot * 1e3:.1f} ms "
          f"({hit} of {n} tokens loaded): cold/warm_hot = {t_cold / t_hot:.1f}x")
    print(f"TTFT cold {t_cold * 1e3:.0f} ms vs warm from disk in a fresh process {t_disk * 1e3:.0f} ms "
          f"({child_out['external']} tokens loaded): cold/warm_disk = {t_cold / t_disk:.1f}x")
    print(f"floor hot: {kv_bytes / 1e6:.0f} MB / {bw_mem:.1f} GB/s {copy_name} "
          f"+ tail {t_tail * 1e3:.1f} ms = "
          f"{floor_hot * 1e3:.1f} ms; warm_hot/floor = {t_hot / floor_hot:.2f}x")
    print(f"floor disk: {kv_bytes / 1e6:.0f} MB / {bw_disk:.2f} GB/s read + tail {t_tail * 1e3:.0f} ms = "
          f"{floor_disk * 1e3:.0f} ms; warm_disk/floor = {t_disk / floor_disk:.2f}x")
    print(f"hot retrieve {gb_hot:.1f} GB/s vs {copy_name} {bw_mem:.1f} GB/s: retrieve/memcpy = "
          f"{gb_hot / bw_mem:.2f}")
    print(f"disk retrieve {gb_disk:.2f} GB/s vs best raw read {bw_disk:.2f} GB/s: "
          f"retrieve/raw = {gb_disk / bw_disk:.2f}")
    print(f"zero-hit TTFT with lmkv {t_zero * 1e3:.0f} ms vs without {t_cold * 1e3:.0f} ms: "
          f"overhead = {t_zero / t_cold:.3f}x")


if __name__ == "__main__":
    main()
