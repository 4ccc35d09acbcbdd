"""KVComputer: what lmkv asks of an inference engine when it needs KV computed itself
(precomputing RAG chunks, calibrating the lossy codec). The bundled engine's LLMEngine is
one; lmkv never imports an engine."""

from __future__ import annotations

from typing import Protocol

import torch


class KVComputer(Protocol):
    """An engine that can compute the KV of standalone token sequences."""

    @property
    def rope_inv_freq(self) -> torch.Tensor | None:
        """The keys' rotary inverse frequencies [D/2] (HF rotate_half convention); None for
        a model whose keys carry no rotation."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def compute_kv(self, token_lists: list[list[int]], pre_rope: bool = False) -> list[torch.Tensor]:
        """KV of each sequence computed alone at positions [0, n): [2, L, n, Hkv, D] each,
        in the engine's KV dtype; with ``pre_rope`` the keys as projected, before RoPE."""
        ...

    def continuation_logits(self, tokens: list[int], prefix_kv: torch.Tensor) -> torch.Tensor:
        """Logits [n - P, vocab] (fp32) of each position of ``tokens[P:]``, attending to
        ``prefix_kv`` [2, L, P, Hkv, D] (keys rotated to their positions, as compute_kv
        returns them) for ``tokens[:P]``: how the model answers over KV it did not compute
        (the codec's calibration weighs each layer's error by it)."""
        ...
