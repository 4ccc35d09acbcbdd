from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def emu():
    """The CPU emulator launcher: the real cuda/*.cu built with g++ (cached by content hash)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the CUDA kernels for the CPU emulator")
    from lmkv_cuda.emu import EmuLauncher

    return EmuLauncher()
