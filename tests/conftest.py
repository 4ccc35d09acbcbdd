from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    """Where tests build their models (kept across tests in one session)."""
    root = os.environ.get("LMKV_TEST_CACHE_DIR")
    return Path(root) if root else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache_dir) -> Path:
    """A small random Llama (GQA 2:1, head_dim 64) with the demo tokenizer."""
    from lmkv_engines.minimal.demo_model import DemoGeometry, ensure_demo_model

    geometry = DemoGeometry(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=64, max_position_embeddings=4096)
    return ensure_demo_model(geometry, cache_dir=model_cache_dir)
