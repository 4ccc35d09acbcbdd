"""Runs real vLLM (with or without lmkv) on a prompt set; started by the vllm tests as
``.venv-vllm/bin/python -m tests.vllm.vllm_workload SPEC_JSON``, it prints one JSON line per
round: the generated tokens, vLLM's cached-token counts and lmkv's counters.

SPEC_JSON keys: model (dir), lmkv (kv_connector_extra_config, or null for plain vLLM),
seeds (one prompt-set seed per round, or [seed, cut]: its prompts cut to that length), n,
length, prefix_caching (vLLM's own prefix cache), max_tokens, fail ({round: "save" or
"load"}: every chunk copy in that direction raises during that round), failure_policy
(vLLM's kv_load_failure_policy), tp (tensor_parallel_size: one worker process per rank,
each on its own core; lmkv's counters are then not reported), kill_pid and kill_after
(SIGKILL that process after that round: a remote store dying mid-run). With metrics_port
in the lmkv config, each round also reports the counters scraped from that port.
"""

from __future__ import annotations

import json
import os
import signal
import sys

# offline, no usage reports (vLLM would try to send them to its stats host), one process
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4096, (length + 37 * i,), generator=g).tolist() for i in range(n)]


def lmkv_counters() -> dict[str, float]:
    from lmkv_engines.vllm.connector import worker_engine

    out: dict[str, float] = {}
    for engine in [worker_engine()]:
        reg = engine.metrics.registry
        for metric in reg.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    label = ",".join(f"{v}" for v in s.labels.values())
                    name = s.name + (f"[{label}]" if label else "")
                    out[name] = out.get(name, 0.0) + s.value
    return out


def _scrape(port: int) -> dict[str, float]:
    """lmkv's counters as its metrics_port serves them over HTTP."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)
            if name.startswith("lmkv_") and name.split("{")[0].endswith("_total")}


def main(spec: dict) -> None:
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("lmkv") is not None:
        kv = KVTransferConfig(
            kv_connector="LMKVConnector", kv_connector_module_path="lmkv_engines.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=spec["lmkv"],
            kv_load_failure_policy=spec.get("failure_policy", "fail"),
        )
    tp = spec.get("tp", 1)
    if tp > 1:  # one process per rank, each bound to its own core
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    llm = LLM(model=spec["model"], enforce_eager=True, dtype="float32", max_model_len=2048,
              enable_prefix_caching=spec.get("prefix_caching", False), kv_transfer_config=kv,
              seed=0, tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    seeds = spec.get("seeds", [0])
    port = (spec.get("lmkv") or {}).get("metrics_port")
    for r, seed in enumerate(seeds):
        seed, cut = seed if isinstance(seed, list) else (seed, None)
        batch = [{"prompt_token_ids": p[:cut]}
                 for p in prompts(spec.get("n", 3), spec.get("length", 300), seed)]
        if str(r) in spec.get("reset", {}):  # as after new weights: lmkv serves nothing stored before
            assert llm.reset_prefix_cache(reset_connector=True)
        fail = spec.get("fail", {}).get(str(r))
        restore = _inject_failure(fail) if fail else None
        try:
            outs = llm.generate(batch, params, use_tqdm=False)
        finally:
            if restore is not None:
                restore()
        print(json.dumps({
            "seed": seed if cut is None else f"{seed}:{cut}",
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "lmkv": lmkv_counters() if kv is not None and tp == 1 else {},  # ranks: elsewhere
            "scraped": _scrape(port) if port else {},
        }), flush=True)
        if spec.get("kill_after") == r:
            os.kill(spec["kill_pid"], signal.SIGKILL)
    # no explicit flush: lmkv finishes its background writes when the process exits


def _inject_failure(direction: str):
    from lmkv_engines.vllm.paged import StridedPagedMemory

    original = getattr(StridedPagedMemory, direction)

    def broken(self, *args, **kwargs):
        raise OSError(f"injected {direction} failure")

    setattr(StridedPagedMemory, direction, broken)
    return lambda: setattr(StridedPagedMemory, direction, original)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
