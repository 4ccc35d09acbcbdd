"""The GPU launcher without a GPU: its fallback, and its CuPy calls against a stand-in CuPy."""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest
import torch

from lmkv_cuda import INSTANTIATIONS, SOURCE_DIR, kv_copy
from lmkv_cuda.launcher import NVRTC_OPTIONS, CupyLauncher, _gpu_launcher, gpu_launcher


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_no_usable_gpu_gives_one_warning_and_none():
    _gpu_launcher.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpu_launcher(0) is None
        assert gpu_launcher(0) is None  # cached: no second warning
    _gpu_launcher.cache_clear()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1 and "using the torch implementations" in messages[0]


def test_sources_are_package_data():
    for file in INSTANTIATIONS:
        assert (SOURCE_DIR / file).is_file()
    assert (SOURCE_DIR / "common.cuh").is_file()
    assert (SOURCE_DIR / "emu" / "include" / "cuemu" / "cuemu.h").is_file()


class _FakeCupy(types.ModuleType):
    """Records what CupyLauncher asks of CuPy."""

    def __init__(self) -> None:
        super().__init__("cupy")
        self.modules, self.calls, self.context = [], [], []
        fake = self

        class RawModule:
            def __init__(self, code, options, name_expressions):
                self.code, self.options, self.names = code, options, list(name_expressions)
                fake.modules.append(self)

            def get_function(self, name):
                assert name in self.names, name

                def kernel(grid, block, args, shared_mem=0):
                    fake.calls.append((name, grid, block, args, shared_mem, list(fake.context)))

                return kernel

        @contextlib.contextmanager
        def scope(kind, value):
            fake.context.append((kind, value))
            yield
            fake.context.pop()

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(
            Device=lambda index: scope("device", index),
            ExternalStream=lambda ptr: scope("stream", ptr),
        )


def test_cupy_launcher_compiles_everything_and_launches_on_torchs_stream(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    stream = types.SimpleNamespace(cuda_stream=0x5EED)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: stream)
    launcher = CupyLauncher(3)
    assert [m.names for m in fake.modules] == list(INSTANTIATIONS.values())
    assert all(m.options == NVRTC_OPTIONS for m in fake.modules)
    assert all("#include" in m.code for m in fake.modules)

    launcher.device_type = "cpu"  # let the wrapper's device check accept CPU tensors
    kv = torch.zeros(2, 2, 4, 8, 2, 64, dtype=torch.float16)
    chunk = torch.zeros(2, 2, 5, 2, 64, dtype=torch.float16)
    slots = torch.arange(5, dtype=torch.int64)
    kv_copy.paged_to_chunk(launcher, kv, slots, chunk, skip=1)
    name, grid, block, args, shared_mem, context = fake.calls[-1]
    assert name == "kv_copy<uint4, false>" and block == (256,) and shared_mem == 0
    assert context == [("device", 3), ("stream", 0x5EED)]
    assert args[2] == kv.data_ptr() and args[9] == chunk[0].data_ptr()  # addresses as ints
    assert args[13] == slots.data_ptr() and int(args[-1]) == 1
