"""How a kernel wrapper reaches a compiled kernel.

A ``Launcher`` turns (source file, name expression) into a callable with CuPy's call shape,
``kernel(grid, block, args, shared_mem=0)``, and turns tensors into pointer arguments. Two
implementations exist: ``CupyLauncher`` (GPU: NVRTC via CuPy ``RawModule``, launched on
torch's current stream, tensors passed by address without copies, any dtype) and
``lmkv_cuda.emu.EmuLauncher`` (CPU tests: the same sources under the emulator). The kernel
wrappers (``lmkv_cuda.kv_copy`` etc.) take the launcher as their first argument.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from lmkv_cuda import INSTANTIATIONS, SOURCE_DIR, headers_digest, read_source

Kernel = Callable[..., None]  # (grid, block, args, shared_mem=0) -> None
log = logging.getLogger(__name__)


class Launcher(Protocol):
    device_type: str  # the device type of the tensors this launcher runs on

    def kernel(self, file: str, name: str) -> Kernel: ...

    def pointer(self, t: torch.Tensor) -> object: ...


NVRTC_OPTIONS = ("-std=c++17", f"-I{SOURCE_DIR}", f"-DLMKV_HEADERS={headers_digest()}")


class CupyLauncher:
    """Kernels on one CUDA device, compiled by NVRTC at first use (CuPy caches cubins on disk)."""

    device_type = "cuda"

    def __init__(self, device_index: int) -> None:
        import cupy

        self._cupy = cupy
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self._modules = {
                file: cupy.RawModule(
                    code=read_source(file), options=NVRTC_OPTIONS, name_expressions=names
                )
                for file, names in INSTANTIATIONS.items()
            }
            for file, names in INSTANTIATIONS.items():  # compile now: failures surface here
                self._modules[file].get_function(names[0])

    @functools.cache  # noqa: B019 - one launcher per device, alive for the process
    def kernel(self, file: str, name: str) -> Kernel:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_index):
            fn = self._modules[file].get_function(name)

        def launch(
            grid: Sequence[int], block: Sequence[int], args: Sequence[object], shared_mem: int = 0
        ) -> None:
            stream = torch.cuda.current_stream(self.device_index).cuda_stream
            with cupy.cuda.Device(self.device_index), cupy.cuda.ExternalStream(stream):
                fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)

        return launch

    def pointer(self, t: torch.Tensor) -> int:
        """The device address as a Python int: CuPy passes it as 8 bytes, exactly what a pointer
        parameter holds (the emulator, which checks parameter types, passes the tensor itself).
        No CuPy array is built: that would cost microseconds per argument on every launch."""
        return t.data_ptr()


_BUILD = threading.Lock()  # one compile per device, whichever thread asks first


def gpu_launcher(device_index: int) -> CupyLauncher | None:
    """The launcher for a CUDA device, or None (with one warning) when CuPy, the driver or
    NVRTC is unusable; callers then take the torch path."""
    with _BUILD:
        return _gpu_launcher(device_index)


@functools.cache
def _gpu_launcher(device_index: int) -> CupyLauncher | None:
    if os.environ.get("LMKV_CUDA_KERNELS", "").strip().lower() in ("0", "false", "off", "no"):
        log.info("lmkv: LMKV_CUDA_KERNELS=0: the torch implementations run instead of the CUDA kernels")
        return None
    log.info("lmkv: compiling the CUDA kernels for cuda:%d with NVRTC (a first start takes about "
             "half a minute; CuPy keeps them in $CUPY_CACHE_DIR, by default ~/.cupy/kernel_cache)",
             device_index)
    start = time.monotonic()
    try:
        launcher = CupyLauncher(device_index)
    except Exception as e:  # ImportError, CUDARuntimeError, CompileException, OSError, ...
        hint = ("Install cupy-cuda13x (or cupy-cuda12x, matching torch's CUDA) for the kernels"
                if isinstance(e, ImportError) else
                "CuPy's kernel cache ($CUPY_CACHE_DIR, by default ~/.cupy/kernel_cache) must be "
                "writable, NVRTC must find CUDA's headers, and the driver must be as new as "
                "CuPy's CUDA")
        message = (f"lmkv: CUDA kernels unavailable ({type(e).__name__}: {e}); using the torch "
                   f"implementations. {hint}.")
        log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return None
    log.info("lmkv: CUDA kernels ready in %.1f s", time.monotonic() - start)
    return launcher


# ---- argument checks shared by the wrappers (no device synchronisation)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_tensor(
    t: torch.Tensor,
    name: str,
    launcher: Launcher,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != launcher.device_type:
        raise ValueError(f"{name} is on {t.device}, the kernel runs on {launcher.device_type}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {list(dtypes)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
        )


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


def num_blocks_for(work_items: int, per_block: int, cap: int = 65535) -> int:
    return max(1, min(cap, -(-work_items // per_block)))
