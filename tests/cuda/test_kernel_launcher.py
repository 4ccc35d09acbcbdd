"""The GPU launcher's fallback on machines where the kernels cannot run."""

from __future__ import annotations

import pytest
import torch

from lmkv_cuda import INSTANTIATIONS, SOURCE_DIR
from lmkv_cuda.launcher import gpu_launcher


def test_no_usable_gpu_gives_one_warning_and_none():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.warns(RuntimeWarning, match="using the torch implementations"):
        assert gpu_launcher.__wrapped__(0) is None


def test_sources_are_package_data():
    for file in INSTANTIATIONS:
        assert (SOURCE_DIR / file).is_file()
    assert (SOURCE_DIR / "common.cuh").is_file()
    assert (SOURCE_DIR / "emu" / "include" / "cuemu" / "cuemu.h").is_file()
