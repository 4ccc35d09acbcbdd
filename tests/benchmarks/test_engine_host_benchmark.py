"""benchmarks/engine_host.py runs at a small size and prints a ratio line per output kind."""

from __future__ import annotations

from . import run_benchmark


def test_engine_host_benchmark_prints_a_ratio_per_output_kind():
    out = run_benchmark("engine_host.py", "--requests", "4", "--short", "64", "--long", "600",
                        "--steps", "8")
    lines = [x for x in out.splitlines() if "long/short = " in x]
    assert [x.split(":")[0] for x in lines] == ["output cumulative", "output delta",
                                                "output final_only"], out
