"""TTFT of real vLLM (CPU) with lmkv, side by side with vLLM's ExampleConnector, in one run.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--prompt-len 4096] [--chunk 128]

A realistic-shape random Llama (8 layers, hidden 768, 12 heads, 2 KV heads, head_dim 64,
~55M parameters, fp32) and one long prompt. Each engine runs in its own process:
- plain vLLM: TTFT cold (fresh prompts), and the tail alone (vLLM's own prefix cache
  holding the prefix: the tokens any external cache leaves to compute);
- vLLM + lmkv: cold (storing), then warm from lmkv's hot cache;
- vLLM + lmkv in a new process, its disk tier only, files dropped from the page cache;
- vLLM + ExampleConnector (the shared-storage debug connector): cold, then warm.
The floor of a warm TTFT is the KV bytes to load / measured bandwidth (memcpy for the hot
cache, raw file reads for the disk) + the tail. Each result line ends with its ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
             num_attention_heads=12, num_key_value_heads=2, head_dim=64)
LMKV_PATH = "lmkv_engines.vllm.connector"


def prompt(n: int, seed: int) -> list[int]:
    from common import random_prompt

    return random_prompt(n, 4096, seed)  # ids the demo tokenizer knows


def make_llm(model: str, connector: str | None, extra: dict, prefix_caching: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if connector == "lmkv":
        kv = KVTransferConfig(kv_connector="LMKVConnector", kv_connector_module_path=LMKV_PATH,
                              kv_role="kv_both", kv_connector_extra_config=extra)
    elif connector == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config=extra)
    return LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=8192, seed=0,
               enable_prefix_caching=prefix_caching, kv_transfer_config=kv)


def ttft(llm, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens vLLM did not compute."""
    from vllm import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens or 0


def drop_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memcpy_gbps(nbytes: int) -> float:
    import torch

    src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def disk_read_gbps(paths: list[Path]) -> float:
    sizes = [p.stat().st_size for p in paths]
    buf = memoryview(bytearray(max(sizes)))
    drop_page_cache(paths)
    start = time.perf_counter()
    for p, n in zip(paths, sizes, strict=True):
        with open(p, "rb", buffering=0) as f:
            f.readinto(buf[:n])
    return sum(sizes) / (time.perf_counter() - start) / 1e9


# ---- one engine per process ----------------------------------------------------------------
def role_plain(a) -> dict:
    llm = make_llm(a.model, None, {}, prefix_caching=True)
    ttft(llm, prompt(a.prompt_len, 99))  # warm-up
    cold = [ttft(llm, prompt(a.prompt_len, 100 + i))[0] for i in range(a.repeats)]
    target = prompt(a.prompt_len, 0)
    ttft(llm, target)
    tail = [ttft(llm, target) for _ in range(a.repeats)]
    return {"cold": statistics.median(cold), "tail": statistics.median(t for t, _ in tail),
            "tail_hit": tail[0][1]}


def lmkv_extra(a, disk: bool) -> dict:
    extra = {"chunk_size": a.chunk, "max_local_cpu_size": 1.0}
    if disk:
        extra.update(local_disk=a.disk, max_local_disk_size=2.0)
    return extra


def role_lmkv(a) -> dict:
    from lmkv_engines.vllm.engines import SharedEngines

    llm = make_llm(a.model, "lmkv", lmkv_extra(a, disk=True), prefix_caching=False)
    ttft(llm, prompt(a.prompt_len, 99))  # warm-up (stored too, never read)
    target = prompt(a.prompt_len, 0)
    cold, _ = ttft(llm, target)
    warm = [ttft(llm, target) for _ in range(a.repeats)]
    engine = SharedEngines.engines()[0]
    engine.storage.io.drain()
    nbytes = warm[0][1] * engine.layout.bytes_per_token
    return {"cold": cold, "warm": statistics.median(t for t, _ in warm), "hit": warm[0][1],
            "kv_bytes": nbytes, "memcpy_gbps": memcpy_gbps(nbytes)}


def role_lmkv_disk(a) -> dict:
    from lmkv_engines.vllm.engines import SharedEngines

    llm = make_llm(a.model, "lmkv", lmkv_extra(a, disk=True), prefix_caching=False)
    ttft(llm, prompt(a.prompt_len, 98))  # warm-up: a miss
    engine = SharedEngines.engines()[0]
    engine.storage.io.drain()
    target = prompt(a.prompt_len, 0)
    files = [engine.storage.tiers[0].backend.root / engine.storage.tiers[0].backend._name(k)
             for k in engine.keys(target)]
    files = [f for f in files if f.exists()]
    gbps = disk_read_gbps(files)
    drop_page_cache(files)
    t, hit = ttft(llm, target)
    return {"warm": t, "hit": hit, "disk_gbps": gbps, "file_bytes": sum(f.stat().st_size for f in files)}


def role_example(a) -> dict:
    llm = make_llm(a.model, "example", {"shared_storage_path": a.disk}, prefix_caching=False)
    ttft(llm, prompt(a.prompt_len, 99))  # warm-up
    target = prompt(a.prompt_len, 0)
    cold, _ = ttft(llm, target)
    warm = [ttft(llm, target) for _ in range(a.repeats)]
    return {"cold": cold, "warm": statistics.median(t for t, _ in warm), "hit": warm[0][1]}


ROLES = {"plain": role_plain, "lmkv": role_lmkv, "lmkv-disk": role_lmkv_disk, "example": role_example}


def run_role(a, role: str, disk: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--model", a.model, "--prompt-len", str(a.prompt_len),
           "--chunk", str(a.chunk), "--repeats", str(a.repeats)]
    if disk is not None:
        cmd += ["--disk", str(disk)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{role} failed:\n{res.stderr[-5000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=128, help="lmkv chunk_size (a multiple of 128)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        print(json.dumps(ROLES[a.role](a)), flush=True)
        return

    from common import realistic_model_dir

    a.model = str(realistic_model_dir(**SHAPE, tie_word_embeddings=True))
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-vllm-bench-"))
    plain = run_role(a, "plain")
    hot = run_role(a, "lmkv", tmp / "lmkv")
    disk = run_role(a, "lmkv-disk", tmp / "lmkv")
    ex = run_role(a, "example", tmp / "example")

    kv_mb = hot["kv_bytes"] / 1e6
    floor_hot = hot["kv_bytes"] / (hot["memcpy_gbps"] * 1e9) + plain["tail"]
    floor_disk = disk["file_bytes"] / (disk["disk_gbps"] * 1e9) + plain["tail"]
    cold = plain["cold"]
    print(f"vLLM {_version()} CPU, prompt {a.prompt_len} tokens, fp32, lmkv chunk {a.chunk}; "
          f"lmkv loads {hot['hit']} tokens ({kv_mb:.1f} MB), ExampleConnector {ex['hit']}, "
          f"vLLM prefix cache {plain['tail_hit']}")
    print(f"floor parts: tail compute {plain['tail'] * 1e3:.0f} ms; memcpy {hot['memcpy_gbps']:.1f} GB/s; "
          f"cold disk read {disk['disk_gbps']:.2f} GB/s")
    print(f"cold TTFT (plain vLLM) {cold * 1e3:.0f} ms; lmkv storing {hot['cold'] * 1e3:.0f} ms; "
          f"ExampleConnector storing {ex['cold'] * 1e3:.0f} ms; lmkv-storing / plain = "
          f"{hot['cold'] / cold:.2f}x")
    print(f"ExampleConnector warm {ex['warm'] * 1e3:.0f} ms: cold/warm = {cold / ex['warm']:.1f}x")
    print(f"lmkv warm from hot cache {hot['warm'] * 1e3:.0f} ms: cold/warm = {cold / hot['warm']:.1f}x")
    print(f"lmkv warm from disk, new process {disk['warm'] * 1e3:.0f} ms: cold/warm = "
          f"{cold / disk['warm']:.1f}x")
    print(f"floor hot {floor_hot * 1e3:.0f} ms: lmkv hot warm/floor = {hot['warm'] / floor_hot:.2f}x")
    print(f"floor disk {floor_disk * 1e3:.0f} ms: lmkv disk warm/floor = {disk['warm'] / floor_disk:.2f}x")


def _version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
