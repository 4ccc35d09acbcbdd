"""lmkv's CUDA C kernels (package data) and their Python wrappers; installed as ``lmkv_cuda``.

Importing this package is cheap: CuPy is imported only by ``lmkv_cuda.launcher`` when a
kernel is about to run on a GPU. ``INSTANTIATIONS`` lists every kernel (template
instantiation) of every source file: the GPU loader, the CPU emulator and the compile
gate all build exactly these.
"""

from __future__ import annotations

import hashlib
import pkgutil
from pathlib import Path

# When the repository root is on sys.path (``python -m pytest`` from a checkout), this folder
# is also importable as ``cuda`` and would hide the ``cuda`` namespace package of NVIDIA's
# Python modules (cuda.pathfinder, which CuPy imports). Extending __path__ keeps them reachable.
__path__ = pkgutil.extend_path(__path__, __name__)

SOURCE_DIR = Path(__file__).parent

_DTYPES = {"float": 4, "__half": 2, "__nv_bfloat16": 2}  # C++ type: bytes
_UNITS = ("uint4", "uint2", "unsigned int", "unsigned short", "unsigned char")  # 16 ... 1 bytes

INSTANTIATIONS: dict[str, list[str]] = {
    "kv_copy.cu": [f"kv_copy<{u}, {d}>" for u in _UNITS for d in ("false", "true")],
    "rope.cu": [f"rerotate_keys<{t}, {v}>" for t, size in _DTYPES.items() for v in (16 // size, 1)],
    "cachegen.cu": [f"cachegen_{op}<{t}>" for op in ("quantize", "dequantize") for t in _DTYPES],
    "paged_attention.cu": [
        *(f"paged_attention<{t}, {d}, {r}>" for t in _DTYPES for d in (64, 128) for r in (1, 4, 8)),
        *(f"paged_decode_warps<{t}, {d}, {r}{lean}>" for t in _DTYPES for d in (64, 128)
          for r in (1, 4, 8) for lean in ("", ", true")),
        *(f"paged_attention_merge<{t}, {d}>" for t in _DTYPES for d in (64, 128)),
    ],
}


def read_source(file: str) -> str:
    return (SOURCE_DIR / file).read_text()


def headers_digest() -> str:
    """A digest of the headers the kernels include: CuPy's cache of compiled kernels is keyed
    by a file's own text and the options, not by what it includes, so the options carry
    this (a changed header served the old cubins after an upgrade)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.cuh")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]
