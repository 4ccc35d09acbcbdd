"""benchmarks/cpu_attention.py runs at a small size and prints its lines (it checks its results)."""

from __future__ import annotations

import shutil

import pytest

from . import run_benchmark


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_cpu_attention_benchmark_prints_a_ratio_per_case_and_dtype():
    out = run_benchmark("cpu_attention.py", "--layers", "2", "--context", "256", "--batch", "3",
                        "--repeats", "1", timeout=120)
    lines = [x for x in out.splitlines() if "torch/native = " in x]
    for dtype in ("float32", "bfloat16"):
        for case in ("1 new query over 256 keys", "8 new queries over 256 keys",
                     "decode batch of 3 x 64 keys"):
            assert sum(x.startswith(f"{dtype}, {case}:") for x in lines) == 1, out
