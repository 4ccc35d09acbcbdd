"""lmkv's C sources built with the system C compiler for this CPU, on first use, into
$LMKV_CACHE_DIR/native (default ~/.cache/lmkv/native); each module that has one loads the
result with ctypes and falls back to torch where none can be built."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` (LMKV_NATIVE_*) turns native code off: 0,
    false, off or no."""
    return os.environ.get(env, "").strip().lower() in ("0", "false", "off", "no")


def cache_root() -> Path:
    """$LMKV_CACHE_DIR, default ~/.cache/lmkv: what lmkv builds or works out once per machine."""
    return Path(os.environ.get("LMKV_CACHE_DIR") or Path.home() / ".cache" / "lmkv")


def cache_dir() -> Path:
    return cache_root() / "native"


def compiler() -> str | None:
    """$CC (a command line: "ccache gcc" works), else cc or gcc on PATH, else None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    """What -march=native builds for: the machine and its CPU's feature list (x86's
    "flags", ARM's "Features" line of /proc/cpuinfo)."""
    features = ""
    with contextlib.suppress(OSError):
        features = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()}\n{features}"


def build(cc: str, source: Path, out_dir: Path, flags: tuple[str, ...] = (),
          libs: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` for this CPU (-O3 -march=native, plus ``flags``, linked with
    ``libs``) into out_dir as a shared library named by a hash of the source, the compiler,
    the flags, the libraries and the CPU's flags, so a stale or foreign build is never loaded;
    written under a temporary name and renamed, so concurrent builds are safe. Raises OSError
    naming the compiler's complaint."""
    command = shlex.split(cc)
    version = subprocess.run([*command, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), version, *flags, _cpu_flags(), *libs]).encode())
    path = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
        pass
    try:
        res = subprocess.run([*command, "-O3", "-march=native", "-shared", "-fPIC", *flags, "-o",
                              tmp.name, str(source), *libs], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise OSError(f"{cc} failed on {source.name}: {res.stderr.strip()[-2000:]}")
        # a temporary file is 0600: readable by whoever may list the cache directory (its
        # mode follows the umask; os.umask would change it for every thread of the process)
        os.chmod(tmp.name, out_dir.stat().st_mode & 0o755)
        os.replace(tmp.name, path)
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    return path
