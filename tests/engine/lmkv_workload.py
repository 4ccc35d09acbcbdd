"""Shared by the lmkv end-to-end tests and the subprocess they start (python -m ...)."""

from __future__ import annotations

import json
import sys

import torch

from lmkv.config import load_config
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CHUNK = 32


def prompts(n: int = 6, length: int = 200, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4096, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def lmkv_llm(model_dir, disk=None, disk_gb=1.0, cpu_gb=0.05, prefix_caching=False, **lmkv):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=cpu_gb,
                      local_disk=str(disk) if disk else None,
                      max_local_disk_size=disk_gb if disk else 0.0, **lmkv)
    return LLM(str(model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20,
               enable_prefix_caching=prefix_caching)


def fail_once_at_layer(llm: LLM, layer: int) -> None:
    """The next forward pass raises at ``layer``'s attention (an out of memory, say)."""
    attn = llm.engine.model.model.layers[layer].self_attn
    real = attn.forward

    def once(*args, **kwargs):
        attn.forward = real
        raise RuntimeError(f"injected forward failure at layer {layer}")

    attn.forward = once


def metric(llm: LLM, name: str, **labels) -> float:
    return llm.engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


if __name__ == "__main__":
    # python -m tests.engine.lmkv_workload MODEL_DIR DISK_DIR|- [ROUNDS [REMOTE_URL|- [ROLE]]]:
    # run the prompts in a separate process (filling or reading lmkv's lower tiers),
    # printing the tokens of each round
    model_dir, disk = sys.argv[1], (None if sys.argv[2] == "-" else sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    remote = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    role = sys.argv[5] if len(sys.argv) > 5 else "both"
    with lmkv_llm(model_dir, disk, remote_url=remote, kv_role=role) as llm:
        for r in range(rounds):
            outs = llm.generate(prompts(seed=r), GREEDY)
            print(json.dumps({"tokens": [o.output_token_ids for o in outs],
                              "external": [o.num_external_tokens for o in outs]}), flush=True)
