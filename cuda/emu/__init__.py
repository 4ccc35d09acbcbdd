"""cuemu: run lmkv's CUDA C kernels on the CPU, for tests on machines without a GPU.

``CpuRawModule(path=..., name_expressions=[...]).get_function(name)`` has the call shape of
``cupy.RawModule``: the same ``.cu`` source is compiled with g++ against ``include/cuemu``
(each CUDA thread becomes a fiber), loaded with ctypes and launched as
``kernel(grid, block, args, shared_mem=0)``. Builds are cached by content hash (source,
included kernel headers, emulator headers, flags) under ``$CUEMU_CACHE`` (default
``$TMPDIR/lmkv-cuemu``).

Arguments follow CuPy's packing rules (Python int -> long long, float -> double) and are
checked against the kernel's real parameter types, so an int32/int64 mix-up fails here
instead of silently corrupting the arguments of a GPU launch.

Race and bounds checks: ``CUEMU_SEED=<n>`` randomises the order in which fibers run between
barriers; ``sanitize="thread"`` / ``"address"`` builds with TSan / ASan (the process must be
started with the matching runtime in ``LD_PRELOAD``: see ``sanitizer_env``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

INCLUDE_DIR = Path(__file__).parent / "include"
_EXPORTED = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)')


def cache_dir() -> Path:
    return Path(os.environ.get("CUEMU_CACHE") or Path(tempfile.gettempdir()) / "lmkv-cuemu")


def sanitizer_env(sanitize: str) -> dict[str, str]:
    """Environment for a subprocess that loads a ``sanitize`` build into Python."""
    lib = {"thread": "libtsan.so", "address": "libasan.so"}[sanitize]
    path = subprocess.run(
        ["g++", f"-print-file-name={lib}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=path)
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    env["TSAN_OPTIONS"] = "halt_on_error=1:report_signal_unsafe=0"
    return env


def _digest_dir(h: hashlib._Hash, root: Path, suffixes: tuple[str, ...]) -> None:
    for p in sorted(root.rglob("*")):
        if p.suffix in suffixes and p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())


class _Info(ctypes.Structure):
    _fields_ = [
        ("thunk", ctypes.c_void_p),
        ("nargs", ctypes.c_int),
        ("sizes", ctypes.POINTER(ctypes.c_int)),
        ("kinds", ctypes.c_char_p),
    ]


class CpuRawModule:
    """A ``.cu`` file built for the CPU; ``get_function`` accepts the name expressions."""

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        code: str | None = None,
        name_expressions: Sequence[str] = (),
        options: Sequence[str] = (),
        sanitize: str | None = None,
    ) -> None:
        if code is None:
            if path is None:
                raise ValueError("CpuRawModule needs path or code")
            code = Path(path).read_text()
        names = list(name_expressions)
        names += [n for n in _EXPORTED.findall(code) if n not in names]
        self._index = {n: i for i, n in enumerate(names)}
        include = [f"-I{Path(path).resolve().parent}"] if path is not None else []
        flags = [
            "-std=c++20", "-O1" if sanitize else "-O2", "-g", "-fPIC", "-shared", "-pthread",
            "-fno-strict-aliasing", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas",
            f"-I{INCLUDE_DIR}", *include, *options,
        ]  # fmt: skip
        if sanitize:
            flags.append(f"-fsanitize={sanitize}")
        exports = "".join(f"CUEMU_EXPORT({i}, {n})\n" for n, i in self._index.items())
        unit = (
            f'#include "cuemu/cuemu.h"\n#line 1 "kernel.cu"\n{code}\nCUEMU_DEFINE_LAUNCH\n{exports}'
        )
        h = hashlib.sha256((unit + "\0" + " ".join(flags)).encode())
        _digest_dir(h, INCLUDE_DIR, (".h",))
        if path is not None:
            _digest_dir(h, Path(path).resolve().parent, (".cuh", ".h"))
        self.library = self._build(unit, flags, h.hexdigest()[:24])
        self.library.cuemu_launch.restype = ctypes.c_int
        self.library.cuemu_launch.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
            ctypes.c_ulong, ctypes.POINTER(ctypes.c_void_p),
        ]  # fmt: skip

    @staticmethod
    def _build(unit: str, flags: list[str], key: str) -> ctypes.CDLL:
        root = cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        so = root / f"{key}.so"
        if not so.exists():
            cpp = root / f"{key}.{os.getpid()}.cpp"
            tmp = root / f"{key}.{os.getpid()}.tmp"
            cpp.write_text(unit)
            r = subprocess.run(
                ["g++", *flags, str(cpp), "-o", str(tmp)], capture_output=True, text=True
            )
            cpp.unlink()
            if r.returncode:
                raise RuntimeError("g++ failed:\n" + r.stderr[-8000:])
            os.replace(tmp, so)  # atomic: concurrent builders agree on the result
        return ctypes.CDLL(str(so))

    def get_function(self, name: str) -> CpuRawKernel:
        info = getattr(self.library, f"cuemu_info_{self._index[name]}")
        info.restype = ctypes.POINTER(_Info)
        return CpuRawKernel(self.library, info().contents, name)


def _pack(a: object) -> tuple[ctypes._SimpleCData | ctypes.Array, str, int]:
    """(storage, kind, size) of an argument as CuPy would pass it (arrays: their address)."""
    torch = sys.modules.get("torch")  # not imported here: sanitizer runs start faster without it
    if torch is not None and isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise TypeError("the CPU emulator needs CPU tensors")
        return ctypes.c_void_p(a.data_ptr()), "p", 8
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p(a.ctypes.data), "p", 8
    if isinstance(a, np.generic):
        kind = a.dtype.kind if a.dtype.kind in "iufb" else "o"
        return ctypes.create_string_buffer(a.tobytes(), a.nbytes), kind, a.nbytes
    if isinstance(a, bool):
        return ctypes.c_bool(a), "b", 1
    if isinstance(a, int):
        return ctypes.c_longlong(a), "i", 8
    if isinstance(a, float):
        return ctypes.c_double(a), "f", 8
    raise TypeError(f"unsupported kernel argument type {type(a)}")


class CpuRawKernel:
    def __init__(self, library: ctypes.CDLL, info: _Info, name: str) -> None:
        self.library, self.info, self.name = library, info, name
        self.sizes = [info.sizes[i] for i in range(info.nargs)]
        self.kinds = info.kinds.decode()

    def __call__(
        self,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: Sequence[object],
        shared_mem: int = 0,
    ) -> None:
        if len(args) != self.info.nargs:
            raise TypeError(f"{self.name}: expects {self.info.nargs} args, got {len(args)}")
        keep, ptrs = [], (ctypes.c_void_p * max(1, len(args)))()
        for i, a in enumerate(args):
            obj, kind, size = _pack(a)
            want_kind, want_size = self.kinds[i], self.sizes[i]
            if (kind, size) != (want_kind, want_size) and not (
                want_kind == "o" and size == want_size
            ):
                raise TypeError(
                    f"{self.name}: arg {i} is {kind}{size * 8} as CuPy would pass it, kernel "
                    f"parameter is {want_kind}{want_size * 8} (use np.int32/np.float32/...)"
                )
            keep.append(obj)
            ptrs[i] = ctypes.cast(ctypes.pointer(obj), ctypes.c_void_p)
        g = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1, 1))[:3])
        b = (ctypes.c_uint * 3)(*(tuple(block) + (1, 1, 1))[:3])
        rc = self.library.cuemu_launch(ctypes.addressof(self.info), g, b, shared_mem, ptrs)
        if rc:
            raise RuntimeError(f"{self.name}: launch failed ({rc}: deadlock or bad block size)")


class EmuLauncher:
    """The ``lmkv_cuda.launcher.Launcher`` of the emulator: kernels run on CPU tensors.

    ``instantiations`` ({file: [name expression]}) narrows what each build compiles, e.g. for
    the slower sanitizer builds; default: all of ``lmkv_cuda.INSTANTIATIONS``."""

    device_type = "cpu"

    def __init__(
        self, sanitize: str | None = None, instantiations: Mapping[str, Sequence[str]] | None = None
    ) -> None:
        from lmkv_cuda import INSTANTIATIONS

        self.sanitize = sanitize
        self.instantiations = INSTANTIATIONS if instantiations is None else instantiations
        self._modules: dict[str, CpuRawModule] = {}

    def kernel(self, file: str, name: str) -> CpuRawKernel:
        from lmkv_cuda import SOURCE_DIR

        if file not in self._modules:
            self._modules[file] = CpuRawModule(
                path=SOURCE_DIR / file,
                name_expressions=self.instantiations[file],
                sanitize=self.sanitize,
            )
        return self._modules[file].get_function(name)

    def pointer(self, t: object) -> object:
        return t
