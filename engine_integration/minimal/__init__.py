"""The bundled minimal engine: Llama-family models over paged KV memory."""
