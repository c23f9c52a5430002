"""The block pool, free-list order, ref counts and prefix cache, with exact block ids."""

from __future__ import annotations

from engine.core.kv_cache_manager import ROOT_HASH, KVCacheManager, hash_block_tokens
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return hits


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv.free_list)


def test_allocation_takes_from_the_front_and_free_appends_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = req("a", list(range(10))), req("b", list(range(5)))
    assert kv.allocate_slots(a, 10)
    assert kv.allocate_slots(b, 5)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    assert free_order(kv) == [5, 6, 7]
    kv.free(a)
    assert a.block_ids == []
    assert free_order(kv) == [5, 6, 7, 2, 1, 0]
    assert [blk.ref_cnt for blk in kv.blocks] == [0, 0, 0, 1, 1, 0, 0, 0]
    c = req("c", list(range(16)))
    assert kv.allocate_slots(c, 16)
    assert c.block_ids == [5, 6, 7, 2]
    assert kv.num_free_blocks == 2


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(13)))
    assert not kv.allocate_slots(a, 13)  # needs 4 blocks
    assert a.block_ids == [] and free_order(kv) == [0, 1, 2]
    assert kv.allocate_slots(a, 8)
    assert kv.allocate_slots(a, 12)  # grows by one
    assert a.block_ids == [0, 1, 2] and kv.num_free_blocks == 0
    assert not kv.allocate_slots(a, 13)
    assert a.block_ids == [0, 1, 2]


def test_hash_chain_and_prefix_hit_with_ref_counts():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(10)))
    assert admit(kv, a) == []
    h0 = hash_block_tokens(ROOT_HASH, (0, 1, 2, 3))
    h1 = hash_block_tokens(h0, (4, 5, 6, 7))
    assert a.block_hashes == [h0, h1]  # the third block (8, 9) is not full
    assert kv.cached == {h0: 0, h1: 1}
    b = req("b", list(range(8)) + [100, 101, 102])
    assert admit(kv, b) == [0, 1]
    assert b.block_ids == [0, 1, 3]
    assert [kv.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.prefix_queries == 21 and kv.prefix_hits == 8


def test_hit_never_covers_the_last_prompt_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    admit(kv, req("a", list(range(8))))
    b = req("b", list(range(8)))  # identical, exactly two full blocks
    assert kv.get_computed_blocks(b) == [0]  # the block holding the last token is recomputed


def test_freed_blocks_keep_their_hash_until_reallocated():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert free_order(kv) == [3, 2, 1, 0]
    assert kv.blocks[0].block_hash is not None and len(kv.cached) == 2
    b = req("b", list(range(9)))
    assert admit(kv, b) == [0, 1]  # lazily evicted blocks come back
    assert b.block_ids == [0, 1, 3]
    assert free_order(kv) == [2]
    kv.free(b)
    c = req("c", [50 + i for i in range(16)])  # takes every block: the old hashes are evicted
    assert kv.allocate_slots(c, 16)
    assert c.block_ids == [2, 3, 1, 0]
    assert kv.cached == {} and all(blk.block_hash is None for blk in kv.blocks)


def test_hash_hit_is_confirmed_against_stored_tokens():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.blocks[0].token_ids = (9, 9, 9, 9)  # as if two different blocks had collided
    assert kv.get_computed_blocks(req("b", list(range(9)))) == []


def test_fork_shares_full_prompt_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    parent, child = req("p", list(range(10))), req("c", list(range(10)))
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    kv.fork(parent, child)
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 8
    assert [kv.blocks[i].ref_cnt for i in range(3)] == [2, 2, 1]
    assert kv.allocate_slots(child, 10)
    assert child.block_ids == [0, 1, 3]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 10 and all(blk.ref_cnt == 0 for blk in kv.blocks)


def test_usage_statistics():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert kv.usage == 0.0 and kv.prefix_hit_rate == 0.0
    admit(kv, req("a", list(range(5))))
    assert kv.usage == 0.5
    admit(kv, req("b", list(range(6))))
    assert kv.prefix_hit_rate == 4 / 11
