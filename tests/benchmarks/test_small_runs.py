"""The benchmarks that docs/ quotes and no other test runs, each at a small size, so that
a change elsewhere cannot leave one broken until someone needs its figures."""

from __future__ import annotations

from . import run_benchmark


def test_lmkv_ttft_prints_its_lines():
    out = run_benchmark("lmkv_ttft.py", "--model", "realistic", "--prompt-len", "512",
                        "--repeats", "1")
    for line in ("TTFT cold", "vs warm hot cache", "warm from disk in a fresh process",
                 "floor hot:", "floor disk:"):
        assert line in out, out


def test_engine_throughput_prints_its_lines():
    out = run_benchmark("engine_throughput.py", "--model", "realistic", "--prompt-len", "64",
                        "--num-seqs", "2", "--decode-tokens", "4", "--repeats", "1")
    assert "prefill 64 tokens: engine" in out and "decode 2 seqs x 4 tokens" in out, out


def test_remote_backends_prints_its_lines():
    out = run_benchmark("remote_backends.py", "--chunks", "4", "--repeats", "1")
    assert "redis get: lmkv" in out, out


def test_server_index_memory_prints_its_lines():
    out = run_benchmark("server_index_memory.py", "--entries", "128", "--churn", "2")
    for policy in ("lru", "prefix_adaptive"):
        assert f"{policy}: " in out and f"{policy}/lru = " in out, out
