"""Stateful (Hypothesis) tests of BlockPool: random allocate / cache / hit / free / evict / reset sequences."""
from collections import Counter
from types import SimpleNamespace

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.v1.core.kv_cache_invariants import check_block_pool
from minivllm.v1.core.block_pool import BlockPool
from minivllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256_cbor

BLOCK_SIZE, NUM_BLOCKS = 2, 10
hasher = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)
tokens = st.lists(st.integers(0, 1), min_size=BLOCK_SIZE, max_size=8 * BLOCK_SIZE)  # tiny alphabet: many shared prefixes


def make_request(rid, toks):
    r = SimpleNamespace(request_id=rid, all_token_ids=list(toks), num_tokens=len(toks), block_hashes=[],
                        lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None)
    r.block_hashes = hasher(r)
    return r


class BlockPoolMachine(RuleBasedStateMachine):
    """Holders stand in for requests: each has token ids, blocks it holds (one per block position) and how many
    leading blocks it registered in the prefix cache."""
    def __init__(self):
        super().__init__()
        init_none_hash(sha256_cbor)
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True)
        self.holders: list[SimpleNamespace] = []
        self.n = 0

    def _new_holder(self, toks, blocks, num_cached):
        self.n += 1
        self.holders.append(SimpleNamespace(req=make_request(f"r{self.n}", toks), blocks=blocks, num_cached=num_cached))

    @rule(toks=tokens)
    def allocate(self, toks):
        """A request with no cache lookup takes fresh blocks for all its tokens."""
        need = -(-len(toks) // BLOCK_SIZE)
        free = self.pool.get_num_free_blocks()
        if need > free:
            try: self.pool.get_new_blocks(need)
            except ValueError: pass
            else: raise AssertionError("get_new_blocks over-allocated")
            assert self.pool.get_num_free_blocks() == free
            return
        blocks = self.pool.get_new_blocks(need)
        assert all(b.block_hash is None and b.ref_cnt == 1 for b in blocks), "a new block kept a hash or a user"
        self._new_holder(toks, blocks, 0)

    @rule(toks=tokens)
    def cache_hit(self, toks):
        """Look the prefix up block by block and claim the hits (touch), like a request arriving."""
        req = make_request("probe", toks)
        hits = []
        for h in req.block_hashes:
            got = self.pool.get_cached_block(h, [0])
            if got is None: break
            assert got[0].block_hash[:-4] == h
            hits.append(got[0])
        self.pool.touch(hits)
        self._new_holder(toks[:len(hits) * BLOCK_SIZE], hits, len(hits))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache_more(self, data):
        """Register more of a holder's full blocks."""
        h = data.draw(st.sampled_from(self.holders))
        full = min(len(h.req.block_hashes), len(h.blocks))
        if full <= h.num_cached: return
        upto = data.draw(st.integers(h.num_cached + 1, full))
        self.pool.take_events()
        self.pool.cache_full_blocks(h.req, h.blocks, h.num_cached, upto, BLOCK_SIZE, 0)
        (ev,) = self.pool.take_events()
        assert len(ev.block_hashes) == upto - h.num_cached and len(ev.token_ids) == (upto - h.num_cached) * BLOCK_SIZE
        h.num_cached = upto

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        h = data.draw(st.sampled_from(self.holders))
        self.holders.remove(h)
        self.pool.free_blocks(reversed(h.blocks))

    @rule(ids=st.sets(st.integers(0, NUM_BLOCKS - 1), max_size=3))
    def evict(self, ids):
        self.pool.evict_blocks(ids)
        assert all(self.pool.blocks[i].block_hash is None for i in ids)

    @rule()
    def reset(self):
        in_use = any(h.blocks for h in self.holders)
        assert self.pool.reset_prefix_cache() == (not in_use)
        if not in_use:
            assert len(self.pool.cached_block_hash_to_block) == 0

    @invariant()
    def invariants(self):
        expected = Counter(b.block_id for h in self.holders for b in h.blocks)
        check_block_pool(self.pool, expected)


BlockPoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestBlockPool = BlockPoolMachine.TestCase


def test_lru_order_after_freeing_a_chain_in_reverse():
    "Seeds: blocks freed tail first are evicted tail first; the shared head survives longest."
    pool = BlockPool(6, enable_caching=True, hash_block_size=BLOCK_SIZE)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(r, blocks, 0, 5, BLOCK_SIZE, 0)
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [5, 4, 3, 2, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [5, 4]
    hits = []
    for h in r.block_hashes:
        got = pool.get_cached_block(h, [0])
        if got is None: break
        hits += got
    assert [b.block_id for b in hits] == [1, 2, 3]


def test_null_block_is_never_freed_or_cached():
    pool = BlockPool(4, enable_caching=True, hash_block_size=BLOCK_SIZE)
    r = make_request("a", [1, 2, 3, 4])
    pool.free_blocks([pool.null_block, pool.null_block])
    pool.touch([pool.null_block])
    pool.cache_full_blocks(r, [pool.null_block, pool.null_block], 0, 2, BLOCK_SIZE, 0)
    pool.evict_blocks([0])
    check_block_pool(pool, Counter())
    assert pool.get_usage() == 0.0 and pool.null_block.block_hash is None
