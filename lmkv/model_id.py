"""A model's identity for chunk keys: the same checkpoint gives the same id in every engine.

The bundled engine and vLLM serving one model directory (same dtype, chunk size and
tensor-parallel split) therefore share entries; two fine-tunes of one architecture do not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES_PER_FILE = 8
SAMPLE_BYTES = 1 << 16


def model_fingerprint(model_dir: str | Path) -> str:
    """Identity of a checkpoint's weights, the same wherever it is copied: its config.json
    and samples of every safetensors file (fine-tunes differ in the samples), or, for a
    single-file checkpoint (GGUF), samples of that file, whose header holds its config."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    if model_dir.is_file():
        _sample_file(h, model_dir, with_name=False)
        return h.hexdigest()
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        _sample_file(h, path, with_name=True)
    return h.hexdigest()


def _sample_file(h, path: Path, with_name: bool) -> None:
    """Hash the size and SAMPLES_PER_FILE evenly spaced SAMPLE_BYTES reads (the first at 0)."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode() if with_name else f"{size}".encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES_PER_FILE):
            f.seek(size * i // SAMPLES_PER_FILE)
            h.update(f.read(SAMPLE_BYTES))
