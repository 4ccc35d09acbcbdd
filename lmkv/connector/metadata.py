"""What the scheduler role hands the worker role each step: keys, token ranges and slots,
never buffers, so the two roles may live in different processes (as under `vllm serve`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoadSpec:
    """Write chunk ``keys[i]`` (pinned in the worker's hot cache by the scheduler role's
    lookup) into the slots ``slot_mappings[i]``, except its first ``skips[i]`` tokens,
    which the engine already holds. A chunk's slot mapping may be shorter than the chunk
    (the request's last loaded chunk, which ends before the last prompt token): its tokens
    past the mapping are not loaded."""

    request_id: str
    keys: list[str]  # each pinned once for this load; the worker takes the pin
    slot_mappings: list[torch.Tensor]  # [n <= chunk_size] int64 each
    skips: list[int]

    def blocks(self, block_size: int) -> set[int]:
        """The engine's KV blocks this load writes into (the skipped tokens' excluded)."""
        return {b for slots, skip in zip(self.slot_mappings, self.skips, strict=True)
                for b in (slots[skip:] // block_size).unique().tolist()}


@dataclass(slots=True)
class SaveSpec:
    """Gather the tokens at ``slot_mappings[i]`` into a new chunk stored under ``keys[i]``;
    ``parent`` is the key of the chunk before ``keys[0]`` in the prompt (None: the first);
    ``position``: the position of ``keys[0]``'s first token (the chunks are consecutive);
    ``lossy``: computed over KV decoded from a lossy codec, so approximate too (stored as
    such: StorageManager.put)."""

    request_id: str
    keys: list[str]
    slot_mappings: list[torch.Tensor]
    parent: str | None = None
    position: int = 0
    lossy: bool = False

    def parents(self) -> dict[str, str | None]:
        """key -> the key of the chunk before it (the cache policy's prefix tree)."""
        return dict(zip(self.keys, [self.parent, *self.keys[:-1]], strict=True))


@dataclass(slots=True)
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
