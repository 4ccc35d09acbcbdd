"""What the attention layers need to know about one forward step's batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """A step's batch: decode sequences first (one query token each), then prefills.

    Token rows [0, num_decodes) belong to decode sequences [0, num_decodes), one each;
    rows [num_decodes, T) to the prefill sequences that follow.
    """

    slot_mapping: torch.Tensor  # [T] int64: where each token's new K/V goes
    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int64: context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int64: rows of each sequence's queries
    num_decodes: int  # sequences [0, num_decodes) have exactly one query token
    # seq_lens and query_start_loc as host tensors too: code that needs their values reads them
    # without waiting for the device (torch's attention on a GPU loops over sequences)
    host_seq_lens: torch.Tensor | None = None
    host_query_start_loc: torch.Tensor | None = None
    launcher: Any = None  # the kernels' launcher when the device does not say (the emulator)
