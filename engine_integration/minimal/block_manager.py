"""Paged KV memory bookkeeping: a block pool with prefix caching by chained block hashes.

Like vLLM V1: a full block's hash is H(parent_hash || its token ids), so equal hashes mean
equal prefixes. Freed blocks keep their hash and stay findable until the free queue hands
them out again; the queue is LRU (oldest freed first), and a request's blocks are freed
tail first so that the most reusable (earliest) blocks are evicted last.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .request import Request

ROOT_HASH = b"\x00" * 16


def hash_block(parent: bytes, token_ids: list[int], salt: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if salt:
        h.update(salt)
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while registered in the prefix cache


@dataclass(slots=True)
class ComputedBlocks:
    blocks: list[Block]
    num_tokens: int  # tokens whose KV those blocks hold


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block id -> None, oldest first; holds exactly the blocks with ref_count 0
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # hash -> the blocks that hold it, by id: several requests computing the same prefix
        # each register their copy, and it stays findable while any copy is (vLLM V1's map)
        self.cached: dict[bytes, dict[int, Block]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def compute_block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of all full blocks of the request's known tokens, salted with its
        ``prefix_cache_salt`` (memoised on the request: only blocks completed since the last call
        are hashed)."""
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, request.token_ids(i * bs, (i + 1) * bs),
                                     request.prefix_cache_salt))
        return hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request. Never covers the
        last token, which must be computed to get logits."""
        if not self.enable_prefix_caching or not request.cacheable:
            return ComputedBlocks([], 0)
        hashes = self.compute_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in hashes[:max_blocks]:
            copies = self.cached.get(h)
            if not copies:
                break
            # a copy some request holds costs no free block; one in the free queue does
            hits.append(next((b for b in copies.values() if b.ref_count), None)
                        or next(iter(copies.values())))
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Give the request blocks for tokens [0, num_computed + cached + num_new_tokens).
        Returns False (changing nothing) if the pool cannot supply them."""
        prefix = computed.blocks if computed else []
        num_computed = request.num_computed_tokens + (computed.num_tokens if computed else 0)
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(request.block_ids) - len(prefix)
        # touching a cached block that sits in the free queue takes it out of the queue
        reclaimed = sum(1 for b in prefix if b.ref_count == 0)
        if needed > self.num_free_blocks - reclaimed:
            return False
        for block in prefix:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            request.block_ids.append(block.block_id)
        for _ in range(max(needed, 0)):
            request.block_ids.append(self._pop_free().block_id)
        if self.enable_prefix_caching and request.cacheable:
            self._cache_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        request.clear_blocks()

    def forget(self, block_ids) -> None:
        """Drop these blocks from the prefix cache: their contents are not what their hashes say."""
        for block_id in block_ids:
            self._unregister(self.blocks[block_id])

    def reset_prefix_cache(self) -> None:
        for copies in self.cached.values():
            for block in copies.values():
                block.block_hash = None
        self.cached.clear()

    def check_integrity(self) -> None:
        """Every block is either referenced or in the free queue, never both; the prefix
        cache maps each hash to the blocks that carry it."""
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            assert (block.ref_count == 0) == in_queue, f"block {block.block_id} ref/queue mismatch"
        for h, copies in self.cached.items():
            assert copies, f"hash {h.hex()} with no block"
            for block_id, block in copies.items():
                assert block.block_id == block_id and block.block_hash == h, \
                    f"block {block_id} hash mismatch"

    def _pop_free(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._unregister(block)  # evicted from the prefix cache
        block.ref_count = 1
        return block

    def _unregister(self, block: Block) -> None:
        if block.block_hash is None:
            return
        copies = self.cached[block.block_hash]
        del copies[block.block_id]
        if not copies:
            del self.cached[block.block_hash]
        block.block_hash = None

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that will be full once tokens [0, num_tokens) are computed; each
        block is offered once while the request holds it (the step's new ones only)."""
        full = num_tokens // self.block_size
        if full <= request.num_registered_blocks:
            return
        hashes = self.compute_block_hashes(request)
        end = min(full, len(hashes))
        for i in range(request.num_registered_blocks, end):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:  # (a prefix-cache hit is registered already)
                block.block_hash = hashes[i]
                self.cached.setdefault(hashes[i], {})[block.block_id] = block
        request.num_registered_blocks = end
