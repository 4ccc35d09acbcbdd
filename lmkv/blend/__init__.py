"""CacheBlend: reuse the KV of RAG chunks wherever they appear in a prompt."""
