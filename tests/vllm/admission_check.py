"""Real vLLM with lmkv, one request decoding while another arrives whose chunks sit on a
slow lower tier (run by test_vllm_connector.py as ``.venv-vllm/bin/python -m
tests.vllm.admission_check SPEC_JSON``; SPEC_JSON: model, disk, chunk_size, read_seconds).
It prints one JSON object: the arriving request's tokens computed and loaded, its cached
tokens, and how long each engine step took while it arrived."""

from __future__ import annotations

import json
import os
import sys
import time

from .vllm_workload import VLLM_ENV, prompts


def main(spec: dict) -> None:
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from lmkv_engines.vllm.connector import worker_engine

    kv = KVTransferConfig(
        kv_connector="LMKVConnector", kv_connector_module_path="lmkv_engines.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={
            "chunk_size": spec["chunk_size"], "max_local_cpu_size": 0.1,
            "local_disk": spec["disk"], "max_local_disk_size": 1.0})
    llm = LLM(model=spec["model"], enforce_eager=True, dtype="float32", max_model_len=2048,
              enable_prefix_caching=False, kv_transfer_config=kv, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = prompts(1, 300, 9)[0]
    other = prompts(1, 60, 10)[0]
    computed = list(llm.generate([{"prompt_token_ids": base}], greedy, use_tqdm=False)[0]
                    .outputs[0].token_ids)
    cache = worker_engine()
    cache.drain()
    cache.storage.hot.clear()  # its chunks are on disk only now
    disk = cache.storage.tiers[0].backend
    real = disk.get_into_many

    def slow(*args, **kwargs):
        time.sleep(spec["read_seconds"])
        return real(*args, **kwargs)

    disk.get_into_many = slow
    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)  # runs throughout
    engine.add_request("other", {"prompt_token_ids": other}, long)
    for _ in range(3):  # its prefill, and decodes
        engine.step()
    engine.add_request("base", {"prompt_token_ids": base}, greedy)  # its prefetch starts now
    steps, done = [], None
    while done is None:
        start = time.perf_counter()
        done = next((o for o in engine.step() if o.request_id == "base" and o.finished), None)
        steps.append(time.perf_counter() - start)
    engine.abort_request(["other"])
    print(json.dumps({"computed": computed, "loaded": list(done.outputs[0].token_ids),
                      "cached": done.num_cached_tokens, "steps": steps}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
