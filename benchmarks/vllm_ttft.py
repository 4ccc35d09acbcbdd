"""TTFT of real vLLM (CPU) with lmkv, side by side with vLLM's ExampleConnector, in one run.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--prompt-len 4096] [--chunk 128]

A realistic-shape random Llama (8 layers, hidden 768, 12 heads, 2 KV heads, head_dim 64,
~55M parameters, fp32) and one long prompt. Each engine runs in its own process, which
alternates TTFT cold (a fresh prompt, stored by the connector), warm (the prompt again,
vLLM's prefix cache emptied first) and the tail (vLLM's prefix cache now holding what was
loaded, it computes only the tokens the connector left it: the prompt again where the load
ended on a block boundary; where it ended one token short of the end, which vLLM's
block-granular prefix cache cannot express, the prompt with one more token, so that vLLM
computes one token over the whole prompt's KV):
- vLLM + lmkv, warm from lmkv's hot cache (after the background disk writes of the previous
  cold prompt finished);
- vLLM + lmkv in a new process, warm from its disk tier only (hot cache emptied and the
  files dropped from the page cache before each warm request);
- vLLM + ExampleConnector (vLLM's shared-storage debug connector), warm from its files in
  the page cache (as it runs), and with them dropped from the page cache first.
The floor of a warm TTFT is the KV bytes to load / measured bandwidth (memcpy for the hot
cache, raw reads of the files for the disk) + the tail. Each result line ends with its
ratio.
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
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # vLLM would report usage to its stats host
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
             num_attention_heads=12, num_key_value_heads=2, head_dim=64)
LMKV_PATH = "lmkv_engines.vllm.connector"


from common import drop_page_cache, raw_read_seconds  # noqa: E402


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
    """The best raw read rate of the files (common.raw_read_seconds: serial, or advised
    WILLNEED and threaded, as lmkv's disk tier reads), dropped from the page cache first."""
    seconds, nbytes = raw_read_seconds(paths)
    return nbytes / seconds / 1e9


# ---- one engine per process ----------------------------------------------------------------
# The machine is shared and noisy: each process alternates its measurements (cold on a fresh
# prompt, warm, tail) so that the ratios it reports see the same conditions.
def measure(llm, a, warm_once, seed0: int) -> dict:
    """Best TTFTs (the machine is shared: the least disturbed run; medians are kept too) over
    ``a.repeats`` rounds of: warm (``warm_once`` prepares it: vLLM's prefix cache emptied,
    ...), the tail (vLLM's prefix cache now holding what was loaded), cold (a fresh prompt)."""
    target = prompt(a.prompt_len, 0)
    warm, tail, cold = [], [], []
    for i in range(a.repeats):
        warm_once()
        warm.append(ttft(llm, target))
        loaded_all_but_one = warm[-1][1] == len(target) - 1
        tail.append(ttft(llm, target + target[-1:] if loaded_all_but_one else target))
        cold.append(ttft(llm, prompt(a.prompt_len, seed0 + i)))
    return {"warm": min(t for t, _ in warm), "hit": warm[0][1], "tail": min(t for t, _ in tail),
            "tail_hit": tail[0][1], "cold": min(t for t, _ in cold),
            "warm_median": statistics.median(t for t, _ in warm)}


def lmkv_extra(a) -> dict:
    return {"chunk_size": a.chunk, "max_local_cpu_size": 1.0, "local_disk": a.disk,
            "max_local_disk_size": 2.0}


def role_lmkv(a) -> dict:
    """Warm from lmkv's hot cache (it stored the prompt in this process)."""
    from lmkv_engines.vllm.connector import worker_engine

    llm = make_llm(a.model, "lmkv", lmkv_extra(a), prefix_caching=True)
    ttft(llm, prompt(a.prompt_len, 99))  # warm-up
    ttft(llm, prompt(a.prompt_len, 0))  # cold: stores the prompt
    engine = worker_engine()

    def quiet() -> None:
        """vLLM's prefix cache emptied, and the previous cold prompt's disk writes (lmkv
        writes below the hot cache in the background) finished: ExampleConnector writes
        inside the cold request, so its warm requests never share the 2 cores with them."""
        llm.reset_prefix_cache()
        engine.storage.io.drain()

    out = measure(llm, a, quiet, 100)
    engine.storage.io.drain()
    out["kv_bytes"] = out["hit"] * engine.layout.bytes_per_token
    out["memcpy_gbps"] = memcpy_gbps(out["kv_bytes"])
    return out


def role_lmkv_disk(a) -> dict:
    """A new process: warm from lmkv's disk tier only (hot cache emptied, files dropped from
    the page cache before each warm request)."""
    from lmkv_engines.vllm.connector import worker_engine

    llm = make_llm(a.model, "lmkv", lmkv_extra(a), prefix_caching=True)
    engine = worker_engine()
    disk = engine.storage.tiers[0].backend
    files = [disk.root / disk._name(k) for k in engine.keys(prompt(a.prompt_len, 0))]
    files = [f for f in files if f.exists()]
    gbps = disk_read_gbps(files)
    ttft(llm, prompt(a.prompt_len, 98))  # warm-up: a miss

    def from_disk() -> None:
        llm.reset_prefix_cache()
        engine.storage.io.drain()
        engine.storage.hot.clear()
        drop_page_cache(files)

    out = measure(llm, a, from_disk, 200)
    out.update(disk_gbps=gbps, file_bytes=sum(f.stat().st_size for f in files))
    return out


def role_example(a) -> dict:
    """ExampleConnector reads the files it wrote: warm from the page cache (as it runs), then
    the same with its files dropped from the page cache first (like lmkv's disk runs)."""
    llm = make_llm(a.model, "example", {"shared_storage_path": a.disk}, prefix_caching=True)
    ttft(llm, prompt(a.prompt_len, 99))  # warm-up
    ttft(llm, prompt(a.prompt_len, 0))  # cold: stores the prompt
    out = measure(llm, a, llm.reset_prefix_cache, 300)

    def from_disk() -> None:
        llm.reset_prefix_cache()
        drop_page_cache([p for p in Path(a.disk).rglob("*") if p.is_file()])

    cold_disk = measure(llm, a, from_disk, 400)
    out.update(warm_disk=cold_disk["warm"], warm_disk_median=cold_disk["warm_median"],
               cold_disk=cold_disk["cold"])
    return out


ROLES = {"lmkv": role_lmkv, "lmkv-disk": role_lmkv_disk, "example": role_example}


def run_role(a, role: str, disk: Path) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--model", a.model, "--prompt-len", str(a.prompt_len),
           "--chunk", str(a.chunk), "--repeats", str(a.repeats), "--disk", str(disk)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{role} failed:\n{res.stderr[-5000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=128, help="lmkv chunk_size (a multiple of 128)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a Hugging Face model directory (SmolLM2-135M-Instruct: "
                    "`.venv/bin/engine export --out DIR` writes it; default: a random model of "
                    "realistic shape)")
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        print(json.dumps(ROLES[a.role](a)), flush=True)
        return

    if a.model is None:
        from common import realistic_model_dir

        a.model = str(realistic_model_dir(**SHAPE, tie_word_embeddings=True))
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-vllm-bench-"))
    hot = run_role(a, "lmkv", tmp / "lmkv")
    disk = run_role(a, "lmkv-disk", tmp / "lmkv")
    ex = run_role(a, "example", tmp / "example")

    floor_hot = hot["kv_bytes"] / (hot["memcpy_gbps"] * 1e9) + hot["tail"]
    floor_disk = disk["file_bytes"] / (disk["disk_gbps"] * 1e9) + disk["tail"]
    print(f"model {Path(a.model).name}")
    print(f"vLLM {_version()} CPU, {a.prompt_len}-token prompt, fp32, best of {a.repeats} alternating runs; "
          f"lmkv chunk {a.chunk}. Tokens loaded: lmkv hot {hot['hit']} ({hot['kv_bytes'] / 1e6:.1f} MB), "
          f"lmkv disk {disk['hit']}, ExampleConnector {ex['hit']}; the tails' vLLM prefix-cache hits "
          f"{hot['tail_hit']} / {disk['tail_hit']} / {ex['tail_hit']}")
    print(f"measured: memcpy {hot['memcpy_gbps']:.1f} GB/s, cold disk read (best raw) "
          f"{disk['disk_gbps']:.2f} GB/s; "
          f"tail compute {hot['tail'] * 1e3:.0f} / {disk['tail'] * 1e3:.0f} / {ex['tail'] * 1e3:.0f} ms "
          f"(hot / disk / example processes)")
    # the cold prefill is the same work in every process: its best time is the common baseline
    cold = min(hot["cold"], disk["cold"], ex["cold"], ex["cold_disk"])
    print(f"cold TTFT (best of all processes) {cold * 1e3:.0f} ms; per process: lmkv hot "
          f"{hot['cold'] * 1e3:.0f}, lmkv disk {disk['cold'] * 1e3:.0f}, ExampleConnector "
          f"{ex['cold'] * 1e3:.0f} / {ex['cold_disk'] * 1e3:.0f} ms")
    for name, warm, median in [
        ("ExampleConnector warm from page cache", ex["warm"], ex["warm_median"]),
        ("ExampleConnector warm from disk", ex["warm_disk"], ex["warm_disk_median"]),
        ("lmkv warm from hot cache", hot["warm"], hot["warm_median"]),
        ("lmkv warm from disk, new process", disk["warm"], disk["warm_median"]),
    ]:
        print(f"{name}: warm {warm * 1e3:.0f} ms (median {median * 1e3:.0f}): cold/warm = {cold / warm:.1f}x")
    print(f"lmkv hot: floor {floor_hot * 1e3:.0f} ms (KV / memcpy + tail), warm {hot['warm'] * 1e3:.0f} ms: "
          f"warm/floor = {hot['warm'] / floor_hot:.2f}x")
    print(f"lmkv disk: floor {floor_disk * 1e3:.0f} ms (files / disk read + tail), warm "
          f"{disk['warm'] * 1e3:.0f} ms: warm/floor = {disk['warm'] / floor_disk:.2f}x")


def _version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
