"""A model's identity for chunk keys: the same checkpoint gives the same id in every engine.

The bundled engine and vLLM serving one model directory (same dtype, chunk size and
tensor-parallel split) therefore share entries; checkpoints whose weights differ in any
byte do not. Every weight byte is hashed (xxh3-128) once per file version: the digest is
remembered under $LMKV_CACHE_DIR/fingerprints (default ~/.cache/lmkv), keyed by the
file's path, size, modification and change times and inode.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash

from .cc import cache_root

log = logging.getLogger(__name__)

# the weights an engine loads: safetensors where there are any, else PyTorch's files (not
# a trainer's optimizer, scheduler, RNG or argument files beside them), else GGUF files (a
# repository's GGUF quantizations beside its safetensors are not loaded from a directory)
SAFETENSORS, PYTORCH, GGUF = ("*.safetensors",), ("*.bin", "*.pt", "*.pth"), ("*.gguf",)
NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state")
READ_BYTES = 16 << 20
LOG_ABOVE = 1 << 30  # a file this large is hashed with a log line (a first start takes seconds)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint ``model_fingerprint`` reads: a file (GGUF), or a
    directory holding a config (config.json, Mistral's params.json) or safetensors."""
    if path.is_file():
        return True
    return path.is_dir() and (any((path / name).is_file() for name in ("config.json", "params.json"))
                              or any(p for pattern in SAFETENSORS for p in path.glob(pattern)))


def model_fingerprint(model_dir: str | Path) -> str:
    """Identity of a checkpoint's weights, the same wherever it is copied: its config
    (config.json, and Mistral's params.json) and the content of every weight file, or, for
    a single-file checkpoint (GGUF), that file's content (its header holds its config)."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    if model_dir.is_file():
        h.update(file_digest(model_dir).encode())
        return h.hexdigest()
    config = model_dir / "config.json"
    if config.is_file():  # (Mistral's repositories ship params.json beside it: not read)
        h.update(config.read_bytes())
    elif (params := model_dir / "params.json").is_file():  # Mistral's own format alone
        h.update(b"params.json:" + params.read_bytes())
    files = (sorted(p for pattern in SAFETENSORS for p in model_dir.glob(pattern))
             or sorted(p for pattern in PYTORCH for p in model_dir.glob(pattern)
                       if not p.name.startswith(NOT_WEIGHTS))
             or sorted(p for pattern in GGUF for p in model_dir.glob(pattern)))
    for path in files:
        h.update(f"{path.name}:{file_digest(path)}".encode())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """xxh3-128 of ``path``'s bytes, remembered per file version (path, size, mtime, ctime,
    inode: a file rewritten in place with its mtime restored changes its ctime)."""
    st = path.stat()
    version = (f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
               f"|{st.st_dev}")
    memo = _memo_dir() / hashlib.blake2b(version.encode(), digest_size=16).hexdigest()
    if (known := _recall(memo)) is not None:
        return known
    with _hashing(memo):  # the ranks of one engine starting at once hash it once
        if (known := _recall(memo)) is not None:
            return known
        return _hash(path, st, memo)


def _hash(path: Path, st: os.stat_result, memo: Path) -> str:
    start = time.monotonic()
    if st.st_size > LOG_ABOVE:
        log.info("lmkv: fingerprinting %s (%.1f GB) for chunk keys, once per file version",
                 path, st.st_size / 1e9)
    h = xxhash.xxh3_128()
    buf = bytearray(min(READ_BYTES, max(st.st_size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    digest = h.hexdigest()
    if st.st_size > LOG_ABOVE:
        log.info("lmkv: fingerprinted %s in %.1f s", path.name, time.monotonic() - start)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):  # (not mid-update)
        _remember(memo, digest)
    return digest


def _recall(memo: Path) -> str | None:
    try:
        known = memo.read_text()
    except OSError:
        return None
    return known if len(known) == 32 and all(c in "0123456789abcdef" for c in known) else None


@contextlib.contextmanager
def _hashing(memo: Path) -> Iterator[None]:
    """An exclusive lock on ``memo``'s lock file while it is hashed (none where the cache
    dir cannot be written)."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(memo.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _memo_dir() -> Path:
    return cache_root() / "fingerprints"


def _remember(memo: Path, digest: str) -> None:
    """Write the memo atomically; a cache dir that cannot be written costs a hash per start."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.{os.urandom(4).hex()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError as e:
        log.debug("lmkv: could not remember a model file's fingerprint in %s: %s", memo.parent, e)
