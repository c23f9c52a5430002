"""Paged KV-cache bookkeeping: the block pool, ref counts, the free list, the prefix cache.

The scheduler sees only ``KVCacheManager``. Block ids index the first dimension of every layer's
KV tensor. The free list is kept in eviction order: allocation takes from its front; a freed
request's blocks go to its back tail-first, so a prompt's last blocks (the least likely to be
shared) are evicted before its first ones. A freed block keeps its hash until it is reallocated
(lazy eviction), so a later request with the same prefix can take it back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.request import Request

ROOT_HASH = -1  # parent hash of a sequence's first block (without a cache salt)


def root_hash(req: Request) -> int:
    """The parent hash of ``req``'s first block: its ``cache_salt`` enters it, so requests
    share cached blocks only under the same salt (or none)."""
    salt = req.params.cache_salt
    if salt is None:
        return ROOT_HASH
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little", signed=True)


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chain a block's token ids onto its parent's hash (deterministic across processes)."""
    return hash((parent_hash, token_ids))


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash to confirm a hit


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ----------------------------------------------------------------- statistics
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_list) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ----------------------------------------------------------------- prefix cache
    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks matching the start of ``req``'s tokens; never the last token's block."""
        # prompt logprobs need every prompt position's logits: no cached prefix (as vLLM)
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self.prefix_queries += req.num_prompt_tokens
        bs = self.block_size
        hits: list[int] = []
        parent = root_hash(req)
        for i in range((req.num_tokens - 1) // bs):
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            h = req.block_hashes[i] if i < len(req.block_hashes) else hash_block_tokens(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        self.prefix_hits += min(len(hits) * bs, req.num_prompt_tokens)
        return hits

    def cache_blocks(self, req: Request) -> None:
        """Register ``req``'s newly full, computed blocks under their chained hashes."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_ids))
        for i in range(len(req.block_hashes), num_full):
            parent = req.block_hashes[i - 1] if i else root_hash(req)
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(parent, tokens)
            req.block_hashes.append(h)
            block = self.blocks[req.block_ids[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, req: Request, num_tokens: int, computed: Sequence[int] = ()) -> bool:
        """Make ``req`` own blocks for its first ``num_tokens`` tokens, prepending the prefix-cache
        hits ``computed`` (only for a request that holds no blocks yet). False, changing nothing,
        when the free list is too short."""
        num_needed = -(-num_tokens // self.block_size) - len(req.block_ids) - len(computed)
        num_revived = sum(1 for b in computed if self.blocks[b].ref_cnt == 0)
        if max(num_needed, 0) + num_revived > len(self.free_list):
            return False
        for block_id in computed:
            self._touch(block_id)
        req.block_ids.extend(computed)
        for _ in range(num_needed):
            req.block_ids.append(self._pop_free())
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Share ``parent``'s full prompt blocks with ``child`` (its sibling of an n > 1 group).
        The child recomputes from the first block that is not full, and always the last prompt
        token, whose logits it samples from."""
        shared = min((parent.num_prompt_tokens - 1) // self.block_size, len(parent.block_ids))
        assert not child.block_ids, "fork into a request that already holds blocks"
        for block_id in parent.block_ids[:shared]:
            self._touch(block_id)
        child.block_ids = parent.block_ids[:shared]
        child.block_hashes = parent.block_hashes[:shared]
        child.num_computed_tokens = child.num_cached_tokens = shared * self.block_size

    def free(self, req: Request) -> None:
        """Drop ``req``'s references; blocks reaching zero go to the back of the free list."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_list[block_id] = None
        req.block_ids = []

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_list[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_list.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_cnt = 1
        return block_id
