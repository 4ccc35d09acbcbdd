"""lmkv: a KV-cache storage and sharing layer for LLM inference."""

__version__ = "0.1.0"
