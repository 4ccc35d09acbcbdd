"""Offline reuse: the second engine (a new process would do the same) loads the prompt's
KV from lmkv's disk tier instead of recomputing it, and returns the same tokens.

    python examples/offline_reuse.py
"""

from __future__ import annotations

import tempfile
import time

from lmkv.config import load_config
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="lmkv-example-") as disk:
        run(load_config(local_disk=disk, max_local_disk_size=1.0, max_local_cpu_size=0.5))


def run(config) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 120
    params = SamplingParams(max_tokens=16, temperature=0)

    with LLM(lmkv_config=config, enable_prefix_caching=False) as llm:
        start = time.perf_counter()
        first = llm.generate([prompt], params)[0]
        print(f"first engine:  {time.perf_counter() - start:.2f}s, "
              f"{first.num_external_tokens} prompt tokens loaded from lmkv")

    with LLM(lmkv_config=config, enable_prefix_caching=False) as llm:  # a restart
        start = time.perf_counter()
        second = llm.generate([prompt], params)[0]
        print(f"second engine: {time.perf_counter() - start:.2f}s, "
              f"{second.num_external_tokens} prompt tokens loaded from lmkv (disk)")
    assert second.output_token_ids == first.output_token_ids
    print("same tokens:", second.text[:60])


if __name__ == "__main__":
    main()
