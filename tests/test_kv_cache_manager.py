"""KVCacheManager: Hypothesis stateful tests (one group and hybrid full + sliding window) over random
schedules, and the seeds' worked examples."""
import os
import subprocess
import sys
from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.v1.core.kv_cache_invariants import check_kv_cache_manager
from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.kv_cache_manager import KVCacheManager
from minivllm.v1.core.kv_cache_utils import (BlockHashListWithBlockSize, get_hash_fn_by_name, get_request_block_hasher,
                                             init_none_hash)
from minivllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager
from minivllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, KVCacheTensor, MambaSpec, SlidingWindowSpec)
from minivllm.v1.request import Request

BS, MAX_LEN = 2, 24
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
SW = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=5)


def make_config(num_blocks, *specs):
    names = [f"l{i}" for i in range(len(specs))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(0, names)],
                         kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in zip(names, specs)])


class KVCacheManagerMachine(RuleBasedStateMachine):
    """A tiny scheduler: waiting requests are admitted with their cache hit (possibly in chunks), running ones
    decode a token per step, are preempted when allocation fails, and finish. Every cache hit is checked against
    what the hit blocks really hold (the token prefix written into them)."""
    SPECS = (FULL,)
    NUM_BLOCKS = 14

    def __init__(self):
        super().__init__()
        hash_fn = get_hash_fn_by_name("sha256_cbor")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BS, hash_fn)
        self.kvm = KVCacheManager(kv_cache_config=make_config(self.NUM_BLOCKS, *self.SPECS), max_model_len=MAX_LEN,
                                  enable_caching=True, hash_block_size=BS, log_stats=True)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.content: dict[tuple[int, int], tuple] = {}  # (group, block_id) -> token prefix its KV was computed from
        self.n = 0

    def _record_content(self, req):
        "Blocks whose tokens are all computed now hold the KV of that token prefix."
        for g, blocks in enumerate(self.kvm.get_blocks(req.request_id).blocks):
            for j in range(req.num_computed_tokens // BS):
                if j < len(blocks) and not blocks[j].is_null:
                    self.content[(g, blocks[j].block_id)] = tuple(req.all_token_ids[:(j + 1) * BS])

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=16))
    def add_request(self, prompt):
        self.n += 1
        self.waiting.append(Request(f"r{self.n}", prompt, SamplingParams(max_tokens=8), block_hasher=self.hasher))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        req = data.draw(st.sampled_from(self.waiting))
        hit, n = self.kvm.get_computed_blocks(req)
        assert n % BS == 0 and n <= req.num_tokens - 1
        for g, blocks in enumerate(hit.blocks):  # a hit must hold exactly this request's prefix
            assert len(blocks) == n // BS
            for j, b in enumerate(blocks):
                if not b.is_null:
                    assert self.content.get((g, b.block_id)) == tuple(req.all_token_ids[:(j + 1) * BS]), \
                        f"cache hit on block {b.block_id} holding other tokens"
        remaining = req.num_tokens - n
        chunk = data.draw(st.integers(1, remaining))
        free_before = self.kvm.block_pool.get_num_free_blocks()
        new = self.kvm.allocate_slots(req, chunk, n, hit)
        if new is None:
            assert self.kvm.block_pool.get_num_free_blocks() == free_before
            assert self.kvm.get_block_ids(req.request_id) == tuple([] for _ in self.SPECS)
            return
        req.num_computed_tokens = n + chunk
        self.waiting.remove(req); self.running.append(req)
        self._record_content(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running(self, data):
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:  # prefill done: sample a token, then decode it
            if req.num_tokens >= MAX_LEN: return
            req.append_output_token_ids(data.draw(st.integers(0, 1)))
        num_new = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        lookahead = data.draw(st.sampled_from([0, 0, 2]))
        if self.kvm.allocate_slots(req, num_new, num_lookahead_tokens=lookahead) is None:  # preempt it
            self.kvm.free(req)
            req.num_computed_tokens, req.num_preemptions = 0, req.num_preemptions + 1
            self.running.remove(req); self.waiting.append(req)
            return
        req.num_computed_tokens += num_new
        self._record_content(req)
        for g, m in enumerate(self.kvm.coordinator.single_type_managers):
            blocks = m.req_to_blocks[req.request_id]
            assert len(blocks) >= -(-req.num_computed_tokens // BS)
            skipped = m.get_num_skipped_tokens(req.num_computed_tokens - num_new) // BS
            assert all(b.is_null for b in blocks[:skipped]), "a block outside the window was kept"

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.kvm.free(req)
        self.running.remove(req)

    @rule(ids=st.sets(st.integers(0, 13), max_size=3))
    def evict(self, ids):
        self.kvm.evict_blocks(ids)

    @rule()
    def reset(self):
        busy = any(any(bl) for r in self.running for bl in self.kvm.get_block_ids(r.request_id))
        assert self.kvm.reset_prefix_cache() == (not busy)

    @rule()
    def stats(self):
        s = self.kvm.make_prefix_cache_stats()
        assert 0 <= s.hits <= s.queries and 0 <= s.preempted_hits <= s.preempted_queries

    @invariant()
    def invariants(self):
        check_kv_cache_manager(self.kvm)
        assert 0.0 <= self.kvm.usage <= 1.0
        for req in self.waiting:
            assert self.kvm.get_block_ids(req.request_id) == tuple([] for _ in self.SPECS)


class HybridKVCacheManagerMachine(KVCacheManagerMachine):
    SPECS = (FULL, SW)
    NUM_BLOCKS = 24


class ThreeTypeKVCacheManagerMachine(KVCacheManagerMachine):
    "Full attention + Mamba (align mode) + chunked local attention: three attention groups, so the hybrid"
    "coordinator iterates to its fixed point instead of stopping after one round."
    SPECS = (FULL,
             MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="align"),
             ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32,
                                       attention_chunk_size=4))
    NUM_BLOCKS = 30


_settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
for _m in (KVCacheManagerMachine, HybridKVCacheManagerMachine, ThreeTypeKVCacheManagerMachine):
    _m.TestCase.settings = _settings
TestKVCacheManager = KVCacheManagerMachine.TestCase
TestHybridKVCacheManager = HybridKVCacheManagerMachine.TestCase
TestThreeTypeKVCacheManager = ThreeTypeKVCacheManagerMachine.TestCase


# ---- the seeds' worked examples -------------------------------------------------------------------------------

def _manager(cls, spec):
    from minivllm.v1.core.block_pool import BlockPool
    return cls(spec, BlockPool(16, True, spec.block_size), enable_caching=True, kv_cache_group_id=0)


def test_sliding_window_4_computed_7_skips_4():
    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=4)
    m = _manager(SlidingWindowManager, spec)
    assert m.get_num_skipped_tokens(7) == 4
    m.allocate_new_blocks("a", 8, 8)
    m.remove_skipped_blocks("a", 7)
    assert [b.block_id for b in m.req_to_blocks["a"]] == [0, 2]  # block of tokens 0-3 replaced by the null block
    assert m.block_pool.blocks[1].ref_cnt == 0 and m.block_pool.get_num_free_blocks() == 14


@pytest.mark.parametrize("computed,skipped", [(13, 8), (8, 8), (7, 0)])
def test_chunked_local_chunk_8(computed, skipped):
    spec = ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32,
                                     attention_chunk_size=8)
    assert _manager(ChunkedLocalAttentionManager, spec).get_num_skipped_tokens(computed) == skipped


def test_block_hash_list_16_to_32_merges_pairs():
    hashes = [bytes([i]) * 4 for i in range(4)]
    merged = BlockHashListWithBlockSize(hashes, 16, 32)
    assert list(merged) == [hashes[0] + hashes[1], hashes[2] + hashes[3]]
    assert len(BlockHashListWithBlockSize(hashes[:3], 16, 32)) == 1  # a half block is not a block


def test_repeated_prompt_hits_L_minus_1_over_block_size_blocks():
    hash_fn = get_hash_fn_by_name("sha256_cbor"); init_none_hash(hash_fn)
    hasher = get_request_block_hasher(4, hash_fn)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32)
    for L in (1, 4, 5, 8, 9, 16, 17):
        kvm = KVCacheManager(make_config(32, spec), max_model_len=64, hash_block_size=4)
        a = Request("a", list(range(L)), SamplingParams(max_tokens=1), block_hasher=hasher)
        kvm.allocate_slots(a, L); kvm.free(a)
        hit, n = kvm.get_computed_blocks(Request("b", list(range(L)), SamplingParams(max_tokens=1), block_hasher=hasher))
        assert len(hit.blocks[0]) == (L - 1) // 4 and n == (L - 1) // 4 * 4


def test_prefix_caching_disabled_never_hits():
    hasher = get_request_block_hasher(4, get_hash_fn_by_name("xxhash"))
    kvm = KVCacheManager(make_config(32, FULL), max_model_len=64, enable_caching=False, hash_block_size=2)
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1), block_hasher=hasher)
    kvm.allocate_slots(a, 9); kvm.free(a)
    assert kvm.get_computed_blocks(a) == (kvm.empty_kv_cache_blocks, 0)
    assert len(kvm.block_pool.cached_block_hash_to_block) == 0


def test_same_pythonhashseed_same_hashes_across_processes():
    "Two fresh interpreters with PYTHONHASHSEED=42 agree on every block hash; seed 43 gives other hashes."
    code = ("import os\n"
            "from minivllm.v1.core.kv_cache_utils import get_hash_fn_by_name, get_request_block_hasher, init_none_hash\n"
            "from minivllm.v1.request import Request\n"
            "fn = get_hash_fn_by_name('sha256_cbor')\n"
            "for seed in (os.environ['PYTHONHASHSEED'], '43'):\n"
            "    os.environ['PYTHONHASHSEED'] = seed; init_none_hash(fn)\n"
            "    r = Request('x', list(range(40)), None, block_hasher=get_request_block_hasher(16, fn))\n"
            "    print(seed, [h.hex() for h in r.block_hashes])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONHASHSEED": "42", "PYTHONPATH": root}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=root) for _ in range(2)]  # concurrently: each start imports torch
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    (a42, a43), (b42, b43) = (o[0].splitlines() for o in outs)
    assert a42 == b42 and a43 == b43, "same seed, different hashes across processes"
    assert a42.split(" ", 1)[1] != a43.split(" ", 1)[1], "the seed does not reach the hashes"
    assert a42.count("'") == 4  # two full blocks of 16 tokens out of 40


def _req(rid, toks, hasher):
    return Request(rid, list(toks), SamplingParams(max_tokens=1), block_hasher=hasher)


def test_hits_on_free_cached_blocks_count_against_capacity():
    "A hit on a free cached block takes it out of the free queue: allocation must see that and answer None."
    hash_fn = get_hash_fn_by_name("sha256_cbor"); init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BS, hash_fn)
    kvm = KVCacheManager(make_config(6, FULL), max_model_len=MAX_LEN, hash_block_size=BS)
    a = _req("a", range(8), hasher)
    kvm.allocate_slots(a, 8); kvm.free(a)                # blocks 1-4 cached and free, block 5 free
    c = _req("c", [9, 9], hasher)
    kvm.allocate_slots(c, 2)                             # takes block 5: 4 free blocks left, all cached
    b = _req("b", list(range(8)) + [7], hasher)
    hit, n = kvm.get_computed_blocks(b)
    assert n == 8
    assert kvm.allocate_slots(b, 1, n, hit) is None       # 4 hits (all free) + 1 new block > 4 free
    check_kv_cache_manager(kvm)
    assert kvm.block_pool.get_num_free_blocks() == 4
    kvm.free(c)
    assert kvm.allocate_slots(b, 1, n, hit).get_block_ids() == ([5],)
    check_kv_cache_manager(kvm)


def test_hybrid_fixed_point_needs_a_second_round():
    """Full + sliding window 5 + sliding window 3 (blocks of 2). Round 1: full offers 20 tokens, window 5 finds
    blocks 7-8 (18 tokens), window 3 only block 3 (8 tokens). Round 2 at 8 tokens: window 5 must re-scan and find
    blocks 2-3; cutting its round-1 answer to 4 blocks would leave it only null blocks."""
    hash_fn = get_hash_fn_by_name("sha256_cbor"); init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BS, hash_fn)
    sw3 = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=3)
    kvm = KVCacheManager(make_config(64, FULL, SW, sw3), max_model_len=64, hash_block_size=BS)
    a = _req("a", range(20), hasher)
    kvm.allocate_slots(a, 20)
    full_ids, sw5_ids, sw3_ids = kvm.get_block_ids("a")
    kvm.free(a)
    kvm.evict_blocks({sw5_ids[i] for i in range(10) if i not in (2, 3, 7, 8)} | {sw3_ids[i] for i in range(10) if i != 3})
    hit, n = kvm.get_computed_blocks(_req("b", list(range(20)) + [1], hasher))
    got = hit.get_block_ids()
    assert n == 8
    assert got[0] == full_ids[:4]
    assert got[1] == [0, 0, sw5_ids[2], sw5_ids[3]]
    assert got[2] == [0, 0, 0, sw3_ids[3]]
