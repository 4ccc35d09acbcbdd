"""What the scheduler role hands the worker role each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..memory import ChunkBuffer


@dataclass(slots=True)
class LoadSpec:
    """Write chunk i of ``chunks`` into the slots ``slot_mappings[i]``, except its first
    ``skips[i]`` tokens, which the engine already holds. A chunk's slot mapping may be
    shorter than the chunk (the request's last loaded chunk, which ends before the last
    prompt token): its tokens past the mapping are not loaded."""

    request_id: str
    chunks: list[ChunkBuffer]  # retained; the worker releases them after loading
    slot_mappings: list[torch.Tensor]  # [n <= chunk_size] int64 each
    skips: list[int]


@dataclass(slots=True)
class SaveSpec:
    """Gather the tokens at ``slot_mappings[i]`` into a new chunk stored under ``keys[i]``."""

    request_id: str
    keys: list[str]
    slot_mappings: list[torch.Tensor]


@dataclass(slots=True)
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
