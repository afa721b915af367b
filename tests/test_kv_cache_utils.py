"""kv_cache_utils: hash functions, hash chain and extra keys, request block hasher, KV cache sizing."""
from types import SimpleNamespace

import pytest
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.kv_cache_utils import (BlockHash, get_block_hash, get_group_id, get_hash_fn_by_name,
                                             get_kv_cache_configs, get_request_block_hasher, hash_block_tokens,
                                             init_none_hash, make_block_hash_with_group_id)
from minivllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from minivllm.v1.request import Request


@pytest.mark.parametrize("name,size", [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16), ("xxhash_cbor", 16)])
def test_hash_functions(name, size):
    fn = get_hash_fn_by_name(name)
    a = hash_block_tokens(fn, None, [1, 2, 3])
    assert len(a) == size and a == hash_block_tokens(fn, None, (1, 2, 3))
    assert a != hash_block_tokens(fn, None, [1, 2, 4]) != hash_block_tokens(fn, a, [1, 2, 4])
    assert a != hash_block_tokens(fn, None, [1, 2, 3], ("salt",))


def test_group_id_packing_round_trip():
    h = BlockHash(bytes(range(32)))
    for gid in (0, 1, 255, 2**32 - 1):
        key = make_block_hash_with_group_id(h, gid)
        assert get_block_hash(key) == h and get_group_id(key) == gid


def test_none_hash_follows_pythonhashseed(monkeypatch):
    fn = get_hash_fn_by_name("sha256_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "5"); init_none_hash(fn); a = hash_block_tokens(fn, None, [1])
    init_none_hash(fn); assert hash_block_tokens(fn, None, [1]) == a
    monkeypatch.delenv("PYTHONHASHSEED"); init_none_hash(fn); b = hash_block_tokens(fn, None, [1])
    init_none_hash(fn); assert hash_block_tokens(fn, None, [1]) != b != a  # random seed each time


def test_block_hasher_is_incremental_and_keyed():
    fn = get_hash_fn_by_name("sha256_cbor"); init_none_hash(fn)
    hasher = get_request_block_hasher(4, fn)
    mk = lambda toks, **kw: Request("r", toks, SamplingParams(max_tokens=4), block_hasher=hasher, **kw)
    r = mk(list(range(7)))
    assert len(r.block_hashes) == 1
    for t in (7, 8, 9, 10):
        r.append_output_token_ids(t)
    assert r.block_hashes == mk(list(range(11))).block_hashes and len(r.block_hashes) == 2
    lora = mk(list(range(8)), lora_request=SimpleNamespace(lora_name="a"))
    salted = mk(list(range(8)), cache_salt="x")
    assert len({tuple(x.block_hashes) for x in (mk(list(range(8))), lora, salted)}) == 3
    mm = lambda off: [SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=off, length=2))]
    a, b = mk(list(range(8)), mm_features=mm(5)), mk(list(range(8)))
    assert a.block_hashes[0] == b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]  # image on tokens 5-6


def _cfg(max_len, override=None):
    return SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_len),
                           cache_config=SimpleNamespace(num_gpu_blocks_override=override))


FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)  # page 1024 B
SW = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64)


def test_sizing_uniform_and_override():
    specs = {f"l{i}": FULL for i in range(3)}
    (c,) = get_kv_cache_configs(_cfg(128), [specs], [3 * 1024 * 100 + 5])
    assert c.num_blocks == 100 and len(c.kv_cache_groups) == 1 and len(c.kv_cache_tensors) == 3
    assert all(t.size == 100 * 1024 for t in c.kv_cache_tensors)
    assert get_kv_cache_configs(_cfg(128, override=9), [specs], [10**6])[0].num_blocks == 9


def test_sizing_hybrid_groups_of_equal_size():
    specs = {f"l{i}": (FULL if i % 2 else SW) for i in range(8)}  # 4 + 4
    (c,) = get_kv_cache_configs(_cfg(128), [specs], [4 * 1024 * 50])
    assert [type(g.kv_cache_spec) for g in c.kv_cache_groups] == [SlidingWindowSpec, FullAttentionSpec]
    assert c.num_blocks == 50 and len(c.kv_cache_tensors) == 4
    assert all(len(t.shared_by) == 2 for t in c.kv_cache_tensors)


def test_sizing_too_small_names_the_largest_length():
    with pytest.raises(ValueError, match="max seq len \\(4096\\).*estimated maximum model length is 160"):
        get_kv_cache_configs(_cfg(4096), [{"l0": FULL, "l1": FULL}], [2 * 1024 * 10])
    with pytest.raises(ValueError, match="No available memory"):
        get_kv_cache_configs(_cfg(16), [{"l0": FULL}], [0])
