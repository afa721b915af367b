"""Invariants of minivllm's BlockPool / KVCacheManager, checked after every step of the stateful tests."""
from collections import Counter

from minivllm.v1.core.block_pool import BlockPool
from minivllm.v1.core.kv_cache_manager import KVCacheManager


def check_free_queue_links(pool: BlockPool) -> list:
    "The free queue is a consistent doubly linked list; returns its blocks front to back."
    q = pool.free_block_queue
    head, tail = q.fake_free_list_head, q.fake_free_list_tail
    assert head.prev_free_block is None and tail.next_free_block is None
    forward, node = [], head.next_free_block
    while node is not tail:
        assert node is not None, "free list broken going forward"
        assert node.next_free_block.prev_free_block is node, f"back link broken at {node.block_id}"
        forward.append(node)
        node = node.next_free_block
        assert len(forward) <= pool.num_gpu_blocks, "cycle in the free list"
    backward, node = [], tail.prev_free_block
    while node is not head:
        backward.append(node)
        node = node.prev_free_block
        assert len(backward) <= pool.num_gpu_blocks, "cycle in the free list (backwards)"
    assert forward == backward[::-1]
    assert len(forward) == q.num_free_blocks, (len(forward), q.num_free_blocks)
    assert len({id(b) for b in forward}) == len(forward), "a block is twice in the free queue"
    return forward


def check_block_pool(pool: BlockPool, expected_ref_cnt: Counter | None = None) -> None:
    "All BlockPool invariants; `expected_ref_cnt[block_id]` (if given) is the number of holders of each block."
    free = check_free_queue_links(pool)
    free_ids = {b.block_id for b in free}
    null = pool.null_block
    assert null is pool.blocks[0] and null.is_null and null.block_id == 0
    assert 0 not in free_ids, "the null block was freed"
    assert null.block_hash is None, "the null block was cached"
    assert null.prev_free_block is None and null.next_free_block is None
    used = 0
    for b in pool.blocks[1:]:
        assert not b.is_null
        if b.block_id in free_ids:
            assert b.ref_cnt == 0, f"free block {b.block_id} has ref_cnt {b.ref_cnt}"
        else:
            assert b.ref_cnt > 0, f"block {b.block_id} is neither free nor referenced"
            assert b.prev_free_block is None and b.next_free_block is None
            used += 1
        if expected_ref_cnt is not None:
            assert b.ref_cnt == expected_ref_cnt.get(b.block_id, 0), (b, expected_ref_cnt.get(b.block_id, 0))
    assert pool.get_num_free_blocks() + used + 1 == pool.num_gpu_blocks  # free + used = total (null is used)
    # the hash map and the blocks' hashes agree, both ways
    seen = set()
    for key, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == key, f"block {b.block_id} is cached under {key.hex()[:8]} but has {b.block_hash}"
        assert not b.is_null
        assert b.block_id not in seen, f"block {b.block_id} twice in the hash map"
        seen.add(b.block_id)
    hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert hashed == seen, f"blocks with a hash but not in the map: {hashed - seen}; in the map without: {seen - hashed}"
    for key, blocks in pool.cached_block_hash_to_block._cache.items():  # single block or a dict of >= 2
        assert not isinstance(blocks, dict) or len(blocks) >= 2
    assert 0.0 <= pool.get_usage() <= 1.0


def manager_ref_counts(kvm: KVCacheManager) -> Counter:
    "How many (request, group) block lists hold each non-null block."
    c = Counter()
    for m in kvm.coordinator.single_type_managers:
        for blocks in m.req_to_blocks.values():
            c.update(b.block_id for b in blocks if not b.is_null)
        for b in getattr(m, "sink_blocks", ()):
            c[b.block_id] += 1
    return c


def check_kv_cache_manager(kvm: KVCacheManager) -> None:
    "BlockPool invariants plus: each block's ref_cnt is the number of request block lists holding it."
    check_block_pool(kvm.block_pool, manager_ref_counts(kvm))
    for m in kvm.coordinator.single_type_managers:
        for rid, blocks in m.req_to_blocks.items():
            n = m.num_cached_block.get(rid, 0)
            assert n <= len(blocks), (rid, n, len(blocks))
            for b in blocks[:n]:  # registered blocks carry this group's id (unless evicted since)
                if not b.is_null and b.block_hash is not None:
                    assert int.from_bytes(b.block_hash[-4:], "big") == m.kv_cache_group_id
