"""benchmarks/cpu_transfer.py runs at a small size and prints its lines (it checks its copies)."""

from __future__ import annotations

import shutil

import pytest

from . import run_benchmark


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_cpu_transfer_benchmark_prints_a_ratio_per_dtype_and_direction():
    out = run_benchmark("cpu_transfer.py", "--tokens", "256", "--chunk", "64", "--layers", "2",
                        "--heads", "2", "--head-dim", "16", "--repeats", "1", timeout=120)
    lines = out.splitlines()
    for dtype in ("float16", "float32"):
        for what in ("load", "save"):
            assert sum(f"{dtype}" in x and f", {what} (chunk" in x and "native/torch = " in x
                       for x in lines) == 1
        assert sum(dtype in x and "native/memcpy = " in x for x in lines) == 1
        for state in ("as they are", "just zeroed"):
            assert sum(dtype in x and f"load into pages {state}" in x and "with plain stores" in x
                       for x in lines) == 1
