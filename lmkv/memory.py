"""A bounded pool of fixed-size CPU slots for chunks, allocated and pre-faulted once.

Each slot holds one chunk and a small header area in front, so that a stored frame
(header + raw KV) can be read from disk or the network straight into the slot. Slots of
large chunks start on, and span whole, pages of DIRECT_ALIGN bytes, so that the disk tier
can read a frame into one with O_DIRECT.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch

from .host_memory import host_memory_available
from .layout import KVLayout

HEADER_BYTES = 64  # room for the codec frame header in front of each chunk
DIRECT_ALIGN = 4096  # what O_DIRECT asks of a read's buffer, offset and length
PAD_MIN_FRAME = 64 * DIRECT_ALIGN  # frames this large are padded to whole pages (<= 1.6% more)
NO_POSITION = 0xFFFFFFFF  # a chunk's position when its keys carry no rotation (before RoPE)


@dataclass(eq=False)
class ChunkBuffer:
    """One slot. Shared by the hot cache and in-flight I/O through reference counts."""

    pool: MemoryPool
    index: int

    @property
    def ref_count(self) -> int:
        return self.pool._refs[self.index]

    @property
    def frame(self) -> torch.Tensor:
        """The frame's bytes: [HEADER_BYTES + chunk_bytes] uint8."""
        return self.pool.storage[self.index, : self.pool.frame_bytes]

    @property
    def slot(self) -> torch.Tensor:
        """The whole slot: the frame and its padding to whole pages, if any."""
        return self.pool.storage[self.index]

    @property
    def kv(self) -> torch.Tensor:
        """The chunk: [2, layers, chunk_size, kv heads, head_dim] in the layout's dtype."""
        lay = self.pool.layout
        return self.frame[HEADER_BYTES:].view(lay.dtype).view(lay.chunk_shape)

    @property
    def lossy(self) -> bool:
        """The chunk was decoded from a lossy codec (approximate KV)."""
        return self.pool._lossy[self.index]

    @lossy.setter
    def lossy(self, value: bool) -> None:
        self.pool._lossy[self.index] = value

    @property
    def num_tokens(self) -> int:
        """Tokens [0, num_tokens) of the chunk hold KV: chunk_size, except for a RAG
        chunk's tail, which is stored at its own size below the hot cache."""
        return self.pool._tokens[self.index]

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        if not 1 <= value <= self.pool.layout.chunk_size:
            raise ValueError(f"a chunk holds 1..{self.pool.layout.chunk_size} tokens, not {value}")
        self.pool._tokens[self.index] = value

    @property
    def position(self) -> int:
        """The position of the chunk's first token in its sequence (0 unless the writer set
        it; ``NO_POSITION``: keys stored before RoPE). A lossy codec may code keys relative
        to it; it never changes what a chunk decodes to."""
        return self.pool._positions[self.index]

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= NO_POSITION:
            raise ValueError(f"chunk position {value} outside [0, 2^32)")
        self.pool._positions[self.index] = value

    def retain(self) -> ChunkBuffer:
        self.pool._retain(self)
        return self

    def release(self) -> None:
        self.pool._release(self)


def zeros_in_memory(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """``torch.zeros`` on the CPU (every page touched now) for the memory ``what`` names:
    ValueError naming it where the machine does not have that much available (each page
    touched past it would end in the OOM killer) or the allocation fails."""
    nbytes = math.prod(shape) * dtype.itemsize
    available = host_memory_available()
    if available is not None and nbytes > available:
        raise ValueError(f"{what}: {nbytes / 1e9:.3g} GB asked, but this machine has "
                         f"{max(available, 0) / 1e9:.3g} GB of memory available; give less")
    try:
        return torch.zeros(shape, dtype=dtype)
    except RuntimeError as e:  # (the allocator's "can't allocate memory")
        raise ValueError(f"{what}: cannot allocate {nbytes / 1e9:.3g} GB ({e}); give less") from e


class MemoryPool:
    def __init__(self, layout: KVLayout, capacity_bytes: int, pin: bool | None = None):
        self.layout = layout
        self.frame_bytes = HEADER_BYTES + layout.chunk_bytes
        self.slot_bytes = self.frame_bytes
        if self.frame_bytes >= PAD_MIN_FRAME:
            self.slot_bytes = -(-self.frame_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"the CPU cache ({capacity_bytes} bytes) cannot hold one chunk "
                f"({self.slot_bytes} bytes); raise max_local_cpu_size or lower chunk_size"
            )
        pin = torch.cuda.is_available() if pin is None else pin
        # torch.zeros writes every page now: fresh pages copy ~20x slower than touched ones
        whole = zeros_in_memory((self.num_slots * self.slot_bytes + DIRECT_ALIGN,), torch.uint8,
                                "lmkv config key max_local_cpu_size (the hot cache)")
        if pin:
            _page_lock(self, whole)
        start = -whole.data_ptr() % DIRECT_ALIGN
        self.storage = whole[start : start + self.num_slots * self.slot_bytes].view(
            self.num_slots, self.slot_bytes)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._refs = [0] * self.num_slots
        self._lossy = [False] * self.num_slots
        self._tokens = [layout.chunk_size] * self.num_slots
        self._positions = [0] * self.num_slots
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> ChunkBuffer | None:
        """A slot with one reference, or None if the pool is exhausted."""
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
            self._refs[index] = 1
            self._lossy[index] = False
            self._tokens[index] = self.layout.chunk_size
            self._positions[index] = 0
        return ChunkBuffer(self, index)

    def _retain(self, buf: ChunkBuffer) -> None:
        with self._lock:
            assert self._refs[buf.index] > 0, f"slot {buf.index} retained after free"
            self._refs[buf.index] += 1

    def _release(self, buf: ChunkBuffer) -> None:
        with self._lock:
            assert self._refs[buf.index] > 0, f"slot {buf.index} released twice"
            self._refs[buf.index] -= 1
            if self._refs[buf.index] == 0:
                self._free.append(buf.index)

    def check_integrity(self) -> None:
        """Each slot is free exactly when it has no references."""
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a slot is on the free list twice"
            for i, refs in enumerate(self._refs):
                assert refs >= 0, f"slot {i} has {refs} references"
                assert (refs == 0) == (i in free), f"slot {i}: {refs} refs, free={i in free}"


def _page_lock(owner: object, memory: torch.Tensor) -> None:
    """Page-lock ``memory`` (host-to-device copies from it run asynchronously) at its own
    size, until ``owner`` is collected. Registered with CUDA rather than allocated pinned:
    torch's pinned allocator rounds a request up to a power of two, so a 40 GiB hot cache
    would lock 64 GiB of the host's memory."""
    cudart = torch.cuda.cudart()
    size = memory.numel() * memory.element_size()
    error = cudart.cudaHostRegister(memory.data_ptr(), size, 0)
    if int(error) != 0:
        raise ValueError(f"cannot page-lock lmkv's {size / 1e9:.3g} GB CPU cache (cudaHostRegister: "
                         f"error {int(error)}): the host, or its container, cannot pin that much "
                         "memory; lower max_local_cpu_size")
    weakref.finalize(owner, _unlock, cudart, memory)  # holds the memory until then


def _unlock(cudart, memory: torch.Tensor) -> None:
    cudart.cudaHostUnregister(memory.data_ptr())
