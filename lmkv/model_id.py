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
    and samples of every safetensors file (fine-tunes differ in the samples)."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(SAMPLES_PER_FILE):
                f.seek(size * i // SAMPLES_PER_FILE)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()
