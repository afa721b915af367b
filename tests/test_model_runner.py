"""Model runner tests: persistent batch, block tables / slot mapping, state updates, and greedy equality with
transformers on a tiny checkpoint (prefill in two chunks, then decode)."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from minivllm.forward_context import get_forward_context
from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from minivllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from minivllm.v1.worker.block_table import BlockTable, MultiGroupBlockTable
from minivllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from minivllm.v1.worker.gpu_model_runner import GPUModelRunner


# ---------------------------------------------------------------- InputBatch.condense
def _state(i, **sp):
    return CachedRequestState(f"r{i}", list(range(10 * i, 10 * i + 2 + i)), SamplingParams(**sp), None,
                              ([100 + i, 200 + i, 300 + i],), i, [7] * i)


def _assert_row(ib, s):
    i = ib.req_id_to_index[s.req_id]
    assert ib.token_ids_cpu[i, :ib.num_tokens[i]].tolist() == s.prompt_token_ids + s.output_token_ids
    assert ib.num_computed_tokens_cpu[i] == s.num_computed_tokens
    bt = ib.block_table[0]
    assert bt.get_numpy_array()[i, :bt.num_blocks_per_row[i]].tolist() == s.block_ids[0]
    sp = s.sampling_params
    assert ib.temperature.np[i] == np.float32(sp.temperature)
    assert ib.top_p.np[i] == np.float32(sp.top_p)
    assert ib.top_k.np[i] == (sp.top_k or ib.vocab_size)
    assert ib.repetition_penalties.np[i] == np.float32(sp.repetition_penalty)


def test_condense_keeps_tokens_blocks_and_sampling_params():
    ib = InputBatch(8, 32, 64, "cpu", False, 1000, [4])
    params = [dict(temperature=0), dict(temperature=0.5, top_p=0.8), dict(top_k=5), dict(temperature=0.3),
              dict(repetition_penalty=1.3, top_k=9), dict(temperature=0.9, top_p=0.5)]
    states = [_state(i, **p) for i, p in enumerate(params)]
    for s in states: ib.add_request(s)
    for rid in ("r0", "r2", "r3"): ib.remove_request(rid)
    ib.condense()
    assert ib.num_reqs == 3 and sorted(ib.req_ids) == ["r1", "r4", "r5"] and None not in ib.req_ids
    assert set(ib.req_id_to_index.values()) == {0, 1, 2}
    for s in (states[1], states[4], states[5]): _assert_row(ib, s)
    ib.refresh_metadata()
    md = ib.sampling_metadata
    assert md.temperature.shape == (3,) and md.top_k.shape == (3,) and not md.no_penalties
    assert md.top_k[ib.req_id_to_index["r4"]] == 9


# ---------------------------------------------------------------- slot mapping
def test_slot_mapping_chunked_prefill_and_decode():
    bt = BlockTable(4, 4, 8, 32, False, "cpu")
    bt.add_row([3, 7], 0); bt.append_row([9], 0); bt.add_row([5], 1)
    # request 0 prefills positions 0..5 (chunk 1): blocks 3, 7
    assert bt.compute_slot_mapping(np.zeros(6, np.int64), np.arange(6)).tolist() == [12, 13, 14, 15, 28, 29]
    # chunk 2 (positions 6..9) together with request 1's decode at position 2
    got = bt.compute_slot_mapping(np.array([0, 0, 0, 0, 1]), np.array([6, 7, 8, 9, 2]))
    assert got.tolist() == [30, 31, 36, 37, 22]


def test_slot_mapping_hybrid_block_sizes():
    # group 0: 16-token blocks; group 1: 32-token allocation blocks served by a 16-token kernel
    mg = MultiGroupBlockTable(2, 128, 16, False, "cpu", block_sizes=[16, 32], kernel_block_sizes=[16, 16])
    mg.add_row(([1, 2], [3]), 0)
    mg.append_row(([4], [6]), 0)
    assert mg[1].get_numpy_array()[0, :4].tolist() == [6, 7, 12, 13]
    mg.compute_slot_mapping(np.zeros(4, np.int64), np.array([0, 17, 33, 40]))
    assert mg[0].slot_mapping.np[:4].tolist() == [16, 33, 65, 72]  # blocks 1, 2, 4, 4
    # 32-token view: pos 17 in block 3 -> 3*32+17 = 113; pos 33, 40 in block 6 -> 193, 200
    assert mg[1].slot_mapping.np[:4].tolist() == [96, 113, 193, 200]


# ---------------------------------------------------------------- runner with a toy paged model
class _SumBackend:
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls(): return _SumBuilder


class _SumBuilder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device): pass
    def build(self, common_prefix_len, common_attn_metadata): return common_attn_metadata


class _SumAttention(nn.Module):
    """Writes token ids to the paged cache and returns, per token, the sum of all ids up to its position
    read back through the block table."""
    attn_backend = _SumBackend

    def __init__(self, name):
        super().__init__(); self.layer_name, self.kv_cache = name, torch.tensor([])

    def get_kv_cache_spec(self, block_size, dtype): return FullAttentionSpec(block_size, 1, 1, torch.float32)

    def forward(self, x):
        ctx = get_forward_context()
        if ctx.attn_metadata is None: return x.cumsum(0)
        md = ctx.attn_metadata[self.layer_name]
        cache = self.kv_cache[0].view(-1)
        cache[ctx.slot_mapping[self.layer_name]] = x
        bs, out = self.kv_cache.shape[2], torch.empty_like(x)
        for r in range(md.num_reqs):
            s, e = int(md.query_start_loc_cpu[r]), int(md.query_start_loc_cpu[r + 1])
            seq = int(md.seq_lens_cpu[r])
            pos = torch.arange(seq)
            vals = cache[md.block_table_tensor[r, pos // bs].long() * bs + pos % bs]
            out[s:e] = vals.cumsum(0)[seq - (e - s):]
        return out


class _SumModel(nn.Module):
    def __init__(self, vocab):
        super().__init__(); self.vocab, self.attn = vocab, _SumAttention("model.layers.0.self_attn.attn")
    def forward(self, input_ids, positions): return self.attn(input_ids.float()).unsqueeze(-1)
    def compute_logits(self, h): return 100.0 * F.one_hot(h[:, 0].long() % self.vocab, self.vocab).float()


def _toy_runner(tmp_path, num_blocks=32, block_size=4):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 50, "hidden_size": 8, "num_attention_heads": 1,
         "num_hidden_layers": 1, "max_position_embeddings": 64}))
    cfg = VllmConfig(ModelConfig(str(tmp_path)), CacheConfig(block_size=block_size),
                     SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64),
                     device_config=DeviceConfig("cpu"))
    runner = GPUModelRunner(cfg, "cpu")
    runner.model = _SumModel(50)
    specs = runner.get_kv_cache_spec()
    spec = next(iter(specs.values()))
    runner.initialize_kv_cache(KVCacheConfig(num_blocks, [KVCacheTensor(num_blocks * spec.page_size_bytes, list(specs))],
                                             [KVCacheGroupSpec(list(specs), spec)]))
    return runner


def _step(runner, new=(), cached=None, nst=None, finished=()):
    nst = nst or {}
    so = SchedulerOutput(list(new), cached or CachedRequestData(), dict(nst), sum(nst.values()),
                         finished_req_ids=set(finished))
    out = runner.execute_model(so)
    return out if out is not None else runner.sample_tokens(None)


def _cached(ids, computed, outputs, new_blocks=None, resumed=()):
    new_blocks = new_blocks or [None] * len(ids)
    return CachedRequestData(list(ids), set(resumed), [[] for _ in ids], {}, new_blocks, list(computed), list(outputs))


def _nxt(toks): return sum(toks) % 50


def _new(rid, prompt, blocks, sp=None, computed=0):
    return NewRequestData(rid, prompt, [], sp or SamplingParams(temperature=0), None, (blocks,), computed)


def test_resumed_request_gets_its_new_blocks(tmp_path):
    runner = _toy_runner(tmp_path)
    a, b = [1, 2, 3, 4, 5], [6, 7]
    out = _step(runner, [_new("a", a, [1, 2]), _new("b", b, [3])], nst={"a": 5, "b": 2})
    a.append(_nxt(a)); b.append(_nxt(b))
    assert out.sampled_token_ids == [[a[-1]], [b[-1]]]
    # a is preempted: not scheduled, leaves the batch, keeps its state
    out = _step(runner, cached=_cached(["b"], [2], [1]), nst={"b": 1})
    b.append(_nxt(b))
    assert out.req_ids == ["b"] and "a" in runner.requests and "a" not in runner.input_batch.req_id_to_index
    # the blocks 1, 2 went to someone else: overwrite them in the cache to prove they are not read
    runner.kv_caches[0][:, 1:3] = 1000.0
    out = _step(runner, cached=_cached(["a", "b"], [0, 3], [1, 2], [([10, 11],), None], resumed={"a"}),
                nst={"a": 6, "b": 1})
    a.append(_nxt(a)); b.append(_nxt(b))
    ia = runner.input_batch.req_id_to_index["a"]
    assert runner.requests["a"].block_ids == ([10, 11],)
    bt = runner.input_batch.block_table[0]
    assert bt.get_numpy_array()[ia, :bt.num_blocks_per_row[ia]].tolist() == [10, 11]
    assert out.sampled_token_ids[out.req_id_to_index["a"]] == [a[-1]]
    assert out.sampled_token_ids[out.req_id_to_index["b"]] == [b[-1]]


def test_unscheduled_request_keeps_state_and_finished_is_dropped(tmp_path):
    runner = _toy_runner(tmp_path)
    a, b = [1, 2, 3], [4, 5, 6]
    _step(runner, [_new("a", a, [1]), _new("b", b, [2])], nst={"a": 3, "b": 3})
    a.append(_nxt(a)); b.append(_nxt(b))
    _step(runner, cached=_cached(["b"], [3], [1]), nst={"b": 1})  # a skipped this step (not preempted)
    b.append(_nxt(b))
    out = _step(runner, cached=_cached(["a", "b"], [3, 4], [1, 2], [None, ([3],)]), nst={"a": 1, "b": 1})
    a.append(_nxt(a)); b.append(_nxt(b))
    assert out.sampled_token_ids[out.req_id_to_index["a"]] == [a[-1]]
    assert out.sampled_token_ids[out.req_id_to_index["b"]] == [b[-1]]
    assert runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"a"})) \
        is EMPTY_MODEL_RUNNER_OUTPUT
    # b was not scheduled either: it leaves the batch but keeps its state
    assert "a" not in runner.requests and "b" in runner.requests and runner.input_batch.req_ids == []


def test_partial_prefill_is_discarded_and_generator_untouched(tmp_path):
    runner = _toy_runner(tmp_path)
    sp = SamplingParams(temperature=1.0, seed=5)
    out = _step(runner, [_new("s", list(range(1, 11)), [1, 2, 3], sp)], nst={"s": 4})
    assert out.sampled_token_ids == [[]]
    gen = runner.requests["s"].generator
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(5).get_state())
    out = _step(runner, cached=_cached(["s"], [4], [0]), nst={"s": 6})
    assert out.sampled_token_ids == [[_nxt(range(1, 11))]]  # one-hot logits: any sample is the argmax
    assert not torch.equal(gen.get_state(), torch.Generator().manual_seed(5).get_state())


# ---------------------------------------------------------------- end to end on a tiny checkpoint
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("minivllm.model_executor.model_loader")
    from minivllm.testing import make_tiny_checkpoint
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


def test_runner_greedy_equals_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM
    cfg = VllmConfig(ModelConfig(tiny_llama, dtype="float32"), CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 20),
                     SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128),
                     device_config=DeviceConfig("cpu"))
    runner = GPUModelRunner(cfg, "cpu")
    runner.load_model()
    specs = runner.get_kv_cache_spec()
    spec = next(iter(specs.values()))
    num_blocks = 16
    runner.initialize_kv_cache(KVCacheConfig(num_blocks, [KVCacheTensor(num_blocks * spec.page_size_bytes, [n]) for n in specs],
                                             [KVCacheGroupSpec(list(specs), spec)]))
    g = torch.Generator().manual_seed(0)
    vocab = cfg.model_config.get_vocab_size()
    p1 = torch.randint(3, vocab, (21,), generator=g).tolist()
    p2 = torch.randint(3, vocab, (6,), generator=g).tolist()
    n_new = 6
    out1, out2 = [], []
    # step 1: p1's first chunk (13 tokens), p2 whole; step 2: p1's last 8 tokens + p2 decode
    sp1 = SamplingParams(temperature=0, prompt_logprobs=2)
    o = _step(runner, [_new("p1", p1, [1, 2], sp1), _new("p2", p2, [3])], nst={"p1": 13, "p2": 6})
    assert o.sampled_token_ids[o.req_id_to_index["p1"]] == [] and "p1" not in o.prompt_logprobs_dict
    out2 += o.sampled_token_ids[o.req_id_to_index["p2"]]
    o = _step(runner, cached=_cached(["p1", "p2"], [13, 6], [0, 1]), nst={"p1": 8, "p2": 1})
    out1 += o.sampled_token_ids[o.req_id_to_index["p1"]]; out2 += o.sampled_token_ids[o.req_id_to_index["p2"]]
    prompt_lp = o.prompt_logprobs_dict["p1"]  # complete once the second chunk ends the prompt
    while len(out1) < n_new:
        o = _step(runner, cached=_cached(["p1", "p2"], [len(p1) + len(out1) - 1, len(p2) + len(out2) - 1],
                                         [len(out1), len(out2)]), nst={"p1": 1, "p2": 1})
        out1 += o.sampled_token_ids[o.req_id_to_index["p1"]]; out2 += o.sampled_token_ids[o.req_id_to_index["p2"]]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, ours in ((p1, out1), (p2, out2[:n_new])):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref
    ref_lp = hf(torch.tensor([p1])).logits[0, :-1].log_softmax(-1)
    assert prompt_lp.logprob_token_ids[:, 0].tolist() == p1[1:]
    assert torch.allclose(prompt_lp.logprobs[:, 0], ref_lp.gather(1, torch.tensor(p1[1:])[:, None])[:, 0], atol=1e-4)
    assert torch.allclose(prompt_lp.logprobs[:, 1:], ref_lp.topk(2, dim=-1).values, atol=1e-4)


def test_uniproc_executor_startup_and_steps(tiny_llama):
    from minivllm.v1.executor.abstract import Executor
    cfg = VllmConfig(ModelConfig(tiny_llama, seed=1), CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 20),
                     SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128),
                     device_config=DeviceConfig("cpu"))
    executor = Executor.get_class(cfg)(cfg)
    try:
        specs, = executor.get_kv_cache_specs()
        avail, = executor.determine_available_memory()
        assert avail == 1 << 20 and len(specs) == cfg.model_config.get_num_layers()
        spec = next(iter(specs.values()))
        num_blocks = avail // (spec.page_size_bytes * len(specs))
        executor.initialize_from_config([KVCacheConfig(
            num_blocks, [KVCacheTensor(num_blocks * spec.page_size_bytes, [n]) for n in specs],
            [KVCacheGroupSpec(list(specs), spec)])])
        so = SchedulerOutput([_new("x", [5, 6, 7, 8], [1])], CachedRequestData(), {"x": 4}, 4)
        fut = executor.execute_model(so, non_block=True)
        assert fut.result() is None
        first = executor.sample_tokens(None).sampled_token_ids[0]
        assert len(first) == 1
        out = executor.execute_model(SchedulerOutput([], _cached(["x"], [4], [1]), {"x": 1}, 1))
        assert out is None and len(executor.sample_tokens(None, non_block=True).result().sampled_token_ids[0]) == 1
        assert executor.collective_rpc(lambda w: w.rank) == [0] and executor.max_concurrent_batches == 1
        with pytest.raises(NotImplementedError, match="no_such_method"):
            executor.collective_rpc("no_such_method")
    finally:
        executor.shutdown()


def test_executor_get_class_by_backend(tiny_llama):
    from minivllm.v1.executor.abstract import Executor
    from minivllm.v1.executor.multiproc_executor import MultiprocExecutor
    from minivllm.v1.executor.ray_executor import RayDistributedExecutor
    cfg = VllmConfig(ModelConfig(tiny_llama), device_config=DeviceConfig("cpu"))
    cfg.parallel_config.distributed_executor_backend = "mp"
    assert Executor.get_class(cfg) is MultiprocExecutor
    cfg.parallel_config.distributed_executor_backend = "ray"
    assert Executor.get_class(cfg) is RayDistributedExecutor
    cfg.parallel_config.distributed_executor_backend = "nccl"
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        Executor.get_class(cfg)


class _SmallKernelBackend(_SumBackend):
    "A backend whose kernel only handles 4-token blocks: 8-token allocation blocks are split in two."
    @staticmethod
    def get_supported_kernel_block_sizes(): return [4]


class _TwoGroupModel(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.a0, self.a1 = _SumAttention("layers.0.attn"), _SumAttention("layers.1.attn")
        self.a1.attn_backend = _SmallKernelBackend

    def forward(self, input_ids, positions):
        x = input_ids.float()
        return ((self.a0(x) + self.a1(x)) / 2).unsqueeze(-1)  # equals the sum only if both groups read right

    def compute_logits(self, h): return 100.0 * F.one_hot(h[:, 0].long() % self.vocab, self.vocab).float()


def test_two_kv_cache_groups_with_split_kernel_blocks(tmp_path):
    runner = _toy_runner(tmp_path)
    runner.model = _TwoGroupModel(50)
    s4 = FullAttentionSpec(4, 1, 1, torch.float32)
    s8 = FullAttentionSpec(8, 1, 1, torch.float32)
    num_blocks = 12  # per group, in allocation blocks; one tensor per layer
    runner.initialize_kv_cache(KVCacheConfig(
        num_blocks, [KVCacheTensor(num_blocks * s4.page_size_bytes, ["layers.0.attn"]),
                     KVCacheTensor(num_blocks * s8.page_size_bytes, ["layers.1.attn"])],
        [KVCacheGroupSpec(["layers.0.attn"], s4), KVCacheGroupSpec(["layers.1.attn"], s8)]))
    bt0, bt1 = runner.input_batch.block_table[0], runner.input_batch.block_table[1]
    assert (bt0.block_size, bt1.block_size, bt1.blocks_per_kv_block) == (4, 4, 2)
    assert runner.model.a0.kv_cache.shape[1:3] == (12, 4) and runner.model.a1.kv_cache.shape[1:3] == (24, 4)
    a, b = list(range(1, 12)), [7, 8, 9]  # 11 and 3 prompt tokens
    out = _step(runner, [NewRequestData("a", a, [], SamplingParams(temperature=0), None, ([1, 2], [1]), 0),
                         NewRequestData("b", b, [], SamplingParams(temperature=0), None, ([5], [4]), 0)],
                nst={"a": 6, "b": 3})
    b.append(_nxt(b))
    assert out.sampled_token_ids == [[], [b[-1]]]
    assert bt1.get_numpy_array()[0, :2].tolist() == [2, 3] and bt1.get_numpy_array()[1, :2].tolist() == [8, 9]
    runner.model.a1.kv_cache[:, 4:8] = 1000.0  # kernel blocks of group-1 blocks 2, 3 (unused) must not be read
    out = _step(runner, cached=CachedRequestData(["a", "b"], set(), [[], []], {}, [([3], [6]), None], [6, 3], [0, 1]),
                nst={"a": 5, "b": 1})
    a.append(_nxt(a)); b.append(_nxt(b))
    assert out.sampled_token_ids == [[a[-1]], [b[-1]]]
    out = _step(runner, cached=CachedRequestData(["a", "b"], set(), [[], []], {}, [None, None], [11, 4], [1, 2]),
                nst={"a": 1, "b": 1})
    a.append(_nxt(a)); b.append(_nxt(b))
    assert out.sampled_token_ids == [[a[-1]], [b[-1]]]


# ---------------------------------------------------------------- sampler
def test_sampler_greedy_is_argmax_and_seeded_rows_ignore_batch():
    from minivllm.v1.sample.metadata import SamplingMetadata
    from minivllm.v1.sample.sampler import Sampler
    sampler = Sampler()
    lg = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    ps = [SamplingParams(temperature=0, seed=4, top_k=5, top_p=0.3), SamplingParams(temperature=0.5, top_k=1),
          SamplingParams(temperature=0)]
    assert sampler(lg.clone(), SamplingMetadata.from_params(ps, 100)).sampled_token_ids[:, 0].tolist() == lg.argmax(-1).tolist()

    def draw(batch, row):
        logits = torch.randn(batch, 100)
        logits[row] = lg[0]
        md = SamplingMetadata.from_params([SamplingParams(temperature=1.0, top_p=0.95)] * batch, 100,
                                          generators={row: torch.Generator().manual_seed(9)})
        return [sampler(logits.clone(), md).sampled_token_ids[row, 0].item() for _ in range(1)]
    assert draw(1, 0) == draw(6, 4)
