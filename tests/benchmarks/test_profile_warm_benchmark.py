"""benchmarks/profile_warm.py (a GPU session's warm step) runs on the CPU at a small size: a
warm request served from lmkv, its TTFT line, then the profile."""

from __future__ import annotations

from . import run_benchmark


def test_profile_warm_serves_the_prompt_from_lmkv_and_prints_a_profile():
    out = run_benchmark("profile_warm.py", "--model", "smollm2-shape", "--prompt-len", "512",
                        "--repeats", "2", "--top", "5", "--served-before", "1")
    assert "warm TTFT" in out and "511 of 512 tokens loaded; 1 other prompts served before" in out, out
    assert "cProfile of 2 warm requests, by own time:" in out, out
