"""What an operator on a GPU machine meets when something is off, checked without a GPU:
each case is a clear error naming what to change, or a fallback that says so."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from .lmkv_workload import CHUNK, GREEDY, prompts


def _refusing_cudart(calls: list):
    return types.SimpleNamespace(
        cudaHostRegister=lambda ptr, size, flags: calls.append(size) or 2,  # cudaErrorMemoryAllocation
        cudaHostUnregister=lambda ptr: 0)


def test_an_engine_on_the_cpu_does_not_page_lock_its_hot_cache(tiny_model_dir, monkeypatch):
    """--device cpu on a machine with a GPU (the GPU busy, say): lmkv's hot cache is not
    page-locked (it was, making a CUDA context on the GPU, and a start that failed there
    failed the CPU engine)."""
    from lmkv.config import load_config
    from lmkv_engines.minimal.llm import LLM

    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _refusing_cudart(calls))
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.05)
    with LLM(str(tiny_model_dir), lmkv_config=cfg, kv_cache_memory=16 << 20, device="cpu") as llm:
        assert llm.generate(prompts(n=1), GREEDY)[0].finished
    assert calls == []


def test_out_of_gpu_memory_at_start_names_the_flag(tiny_model_dir, monkeypatch):
    from lmkv_engines.minimal.llm import LLM

    def no_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to", no_memory)
    with pytest.raises(ValueError, match=r"out of GPU memory .*--kv-cache-memory"):
        LLM(str(tiny_model_dir), kv_cache_memory=16 << 20)


def test_the_cuda_kernels_can_be_turned_off_and_their_cache_key_covers_the_headers(
        tmp_path, monkeypatch):
    """LMKV_CUDA_KERNELS=0 runs the torch implementations, without a warning; the kernels'
    compile cache (CuPy's, keyed by a file's text and the options) is told the headers'
    digest, so an upgrade that changes only a header compiles anew (it served the old
    kernels)."""
    import lmkv_cuda
    from lmkv_cuda import launcher

    monkeypatch.setenv("LMKV_CUDA_KERNELS", "off")
    launcher._gpu_launcher.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert launcher.gpu_launcher(0) is None
    finally:
        launcher._gpu_launcher.cache_clear()
    assert f"-DLMKV_HEADERS={lmkv_cuda.headers_digest()}" in launcher.NVRTC_OPTIONS
    (tmp_path / "common.cuh").write_text("#define A 1\n")
    monkeypatch.setattr(lmkv_cuda, "SOURCE_DIR", tmp_path)
    before = lmkv_cuda.headers_digest()
    (tmp_path / "common.cuh").write_text("#define A 2\n")
    assert lmkv_cuda.headers_digest() != before
