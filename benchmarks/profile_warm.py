"""Where a warm request's time goes: the engine with lmkv (a hot cache over a disk tier, as in
lmkv_ttft.py) answers a prompt whose KV is in the hot cache; prints the median TTFT, the
device syncs torch reports during those requests (its sync debug mode, CUDA only; CuPy's
are not seen) and cProfile's functions by own time over more of them. ``--served-before N``
first serves N other prompts of the same length through lmkv, as lmkv_ttft.py does before
its warm requests (the engine's freed blocks then come back in another order, and lmkv's
hot cache and disk tier hold more).

    python benchmarks/profile_warm.py --device cuda --dtype bfloat16 --model smollm2-shape
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import MODEL_HELP, add_device_args, bench_model, random_prompt  # noqa: E402
from lmkv_ttft import FIRST_TOKEN, disk_llm, engine_args, ttft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--model", help=MODEL_HELP)
    add_device_args(ap)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--served-before", type=int, default=0,
                    help="other prompts served through lmkv before the warm ones")
    args = ap.parse_args()

    model_dir = bench_model(args.model)
    llm = disk_llm(model_dir, Path(tempfile.mkdtemp(prefix="lmkv-warm-")) / "disk", args.chunk,
                   engine_args(args))
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompt(args.prompt_len, vocab, seed=0)
    for i in range(args.served_before):
        ttft(llm, random_prompt(args.prompt_len, vocab, seed=1000 + i))
    llm.generate([prompt], FIRST_TOKEN)
    llm.engine.kv_connector.cache.drain()
    ttft(llm, prompt)
    warm = [ttft(llm, prompt) for _ in range(args.repeats)]
    hit = llm.generate([prompt], FIRST_TOKEN)[0].num_external_tokens
    print(f"warm TTFT {statistics.median(warm) * 1e3:.2f} ms (median of {args.repeats}; "
          f"min {min(warm) * 1e3:.2f}), {hit} of {len(prompt)} tokens loaded; "
          f"{args.served_before} other prompts served before")

    if llm.engine.device.torch.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ttft(llm, prompt)
        torch.cuda.set_sync_debug_mode(0)
        sites = Counter(f"{w.filename}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message))
        print(f"device syncs torch saw in 3 warm requests: {sum(sites.values())}")
        for site, n in sites.most_common(12):
            print(f"  {n:4d}  {site}")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.repeats):
        ttft(llm, prompt)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"cProfile of {args.repeats} warm requests, by own time:")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))
    llm.close()


if __name__ == "__main__":
    main()
