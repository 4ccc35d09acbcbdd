"""cachegen's decode loops in C (native.c): built with the system C compiler on first use
into $LMKV_CACHE_DIR (default ~/.cache/lmkv), linked to the system's libzstd, loaded with
ctypes. Where no compiler or libzstd is found, or with LMKV_NATIVE_DECODE=0, ``library()``
is None (logged once) and cachegen decodes with torch: the same chunk to float32 rounding."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
DISABLE_ENV = "LMKV_NATIVE_DECODE"
ERRORS = {-1: "truncated stream descriptors", -2: "bad width or truncated",
          -3: "length does not match its symbols", -4: "does not decode",
          -5: "stray bytes after the last stream", -6: "out of memory"}

_P, _I64P, _SZ, _INT = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_int


def cache_dir() -> Path:
    return Path(os.environ.get("LMKV_CACHE_DIR") or Path.home() / ".cache" / "lmkv") / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(cc: str, zstd: str, out_dir: Path, flags: tuple[str, ...] = ()) -> Path:
    """Compile native.c for this CPU (-march=native, plus ``flags``) into out_dir, named by a
    hash of the source, the compiler, the flags, the CPU's flags and libzstd, so a stale or
    foreign build is never loaded; written under a temporary name and renamed, so concurrent
    builds are safe."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, *flags, _cpu_flags(), zstd]).encode())
    path = out_dir / f"cachegen-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
        pass
    try:
        res = subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", *flags, "-o", tmp.name,
                              str(SOURCE), f"-l:{zstd}"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise OSError(f"{cc} failed on {SOURCE.name}: {res.stderr.strip()[-2000:]}")
        os.replace(tmp.name, path)
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded decoder, or None (the reason logged once) to decode with torch."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("cachegen: native decode off (%s=0); decoding with torch", DISABLE_ENV)
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    zstd = ctypes.util.find_library("zstd")
    try:
        if cc is None or zstd is None:
            raise OSError("no C compiler (cc, gcc or $CC)" if cc is None else "no libzstd")
        path = build(cc, zstd, cache_dir())
        lib = load(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cachegen: no native decoder (%s); decoding with torch, at about half the speed", e)
        return None
    log.info("cachegen: native decoder %s (%s)", path,
             "AMX" if lib.lmkv_amx() else "no AMX: the matmul runs in torch")
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A built native.c with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.lmkv_symbols.restype = ctypes.c_long
    lib.lmkv_symbols.argtypes = [_P, _SZ, _SZ, _INT, _P, _P, _P, _P, _SZ, _P, _INT, _P, _I64P]
    lib.lmkv_finish.restype = _INT
    lib.lmkv_finish.argtypes = [_INT] * 4 + [_P] * 5 + [_INT, _P, _P, _P, _INT, _P, _P]
    lib.lmkv_amx.restype = _INT
    lib.lmkv_amx.argtypes = []
    lib.lmkv_decode_amx.restype = ctypes.c_long
    lib.lmkv_decode_amx.argtypes = ([_P, _SZ, _SZ, _INT, _P, _P, _P] + [_INT] * 4 + [_P] * 5
                                    + [_INT, _P, _P, _P, _SZ, _P, _I64P])
    return lib
