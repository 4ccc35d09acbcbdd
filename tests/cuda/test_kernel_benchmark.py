"""benchmarks/kernels.py runs: without a GPU it says so; --emulate exercises its plumbing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_gpu_exits_zero():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "no CUDA GPU present" in r.stdout


def test_emulated_run_prints_every_kernel(emu):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--emulate"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("paged_to_chunk", "chunk_to_paged_vllm", "reshape_and_cache", "rerotate_keys",
                 "paged_attention_decode", "decode, kernel tiles", "paged_attention_prefill",
                 "prefill q=16 over"):  # fmt: skip
        assert name in r.stdout
    for direction in ("host->device", "device->host"):  # the paged <-> pinned transfer lines
        assert f"{direction} pinned copy" in r.stdout
        for kind in ("staged", "mapped"):
            assert f"{direction} chunk<->pages {kind}" in r.stdout and f"{kind}/copy = " in r.stdout


def test_launch_overhead_runs_anywhere():
    script = SCRIPT.parent / "launch_overhead.py"
    r = subprocess.run([sys.executable, str(script), "--calls", "20", "--layers", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("checked/prepared = ") == 2


def test_sass_loop_counts_the_main_loop_not_the_shuffle_slow_paths(monkeypatch):
    """The loop is the longest backward branch whose span holds no EXIT: a shuffle's slow
    path after the last EXIT that jumps back into the loop (longer span) is not it."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from sass_loop import loop_counts

    sass = """
        Function : _Z1kv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R2, R3, R4 ;
        /*0020*/                   BRA.DIV UR4, 0x80 ;
        /*0030*/                   SHFL.BFLY PT, R5, R2, 0x1, 0x1f ;
        /*0040*/               @P0 BRA 0x10 ;
        /*0050*/                   FADD R2, R2, R3 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70 ;
        /*0080*/                   WARPSYNC.ALL ;
        /*0090*/                   BRA 0x30 ;
"""
    loop = loop_counts(sass)["_Z1kv"]
    assert loop.instructions == 4 and loop.opcodes["FFMA"] == 1 and loop.opcodes["SHFL"] == 1


def test_sass_loop_runs_anywhere():
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "sass_loop.py")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "needs" in r.stdout or r.stdout.count("loop/first = ") == 2
