"""Triton kernels and the Triton attention backend against the torch reference.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before anything imports
them), so shapes stay tiny. Random mixed batches (decodes, prompts, chunks after cached context, padding
slots) through `reshape_and_cache` + `unified_attention` must give the reference's cache bit for bit and
its outputs to float rounding; a tiny model served with MINIVLLM_ATTENTION_BACKEND=TRITON_ATTN must
generate the torch reference's greedy tokens. The GPU tests (skipped without CUDA) repeat the model check
on CUDA with the Triton backend chosen by default, and with FULL / FULL_DECODE_ONLY CUDA graphs.
"""
import gc
import os
import random

import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from minivllm_kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from minivllm_kernels.unified_attention import unified_attention  # noqa: E402
from minivllm.entrypoints.llm import LLM  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.testing import make_common_attn_metadata, make_tiny_checkpoint  # noqa: E402
from minivllm.v1.attention.backends.torch_ref import TorchRefAttentionBackend  # noqa: E402
from minivllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_case(seed, device="cpu", dtype=torch.float32):
    "One random mixed step through both paths; returns (max output error, caches equal)."
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = rng.choice([4, 16])
    Hkv, ratio, D = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([8, 16])
    window, soft_cap = rng.choice([None, None, 5, 17]), rng.choice([None, 5.0])
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.5: ctx, q = rng.randint(0, 40), 1
        else: ctx, q = rng.choice([0, rng.randint(1, 30)]), rng.randint(2, 20)
        query_lens.append(q); seq_lens.append(ctx + q)
    need = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(need) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    pad = rng.randint(0, 3)
    cm = make_common_attn_metadata(query_lens, seq_lens, tables, bs, device=device, pad_tokens=pad)
    T, Hq = cm.num_actual_tokens + pad, Hkv * ratio
    kv = torch.randn(2, num_blocks, bs, Hkv, D, generator=g).to(device, dtype)
    query, key, value = (torch.randn(T, H * D, generator=g).to(device, dtype) for H in (Hq, Hkv, Hkv))
    spec = SlidingWindowSpec(bs, Hkv, D, dtype, sliding_window=window) if window else FullAttentionSpec(bs, Hkv, D, dtype)
    md = TorchRefAttentionBackend.get_builder_cls()(spec, ["l"], None, device).build(0, cm)
    impl = TorchRefAttentionBackend.get_impl_cls()(Hq, D, D ** -0.5, Hkv, sliding_window=window, logits_soft_cap=soft_cap)
    kv_tri = kv.clone()
    ref = impl.forward(None, query, key, value, kv, md)
    out = torch.full((T, Hq, D), 3.0, dtype=dtype, device=device)
    reshape_and_cache(key.view(T, Hkv, D), value.view(T, Hkv, D), kv_tri[0], kv_tri[1], cm.slot_mapping)
    unified_attention(query.view(T, Hq, D), kv_tri[0], kv_tri[1], out, cm.query_start_loc, cm.seq_lens,
                      cm.block_table_tensor, D ** -0.5, cm.max_query_len, window, soft_cap)
    n = cm.num_actual_tokens
    assert (out[n:] == 3.0).all(), "padding rows were written"
    return (out[:n].reshape(n, -1).float() - ref[:n].float()).abs().max().item(), torch.equal(kv_tri, kv)


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batch_matches_reference(seed):
    err, same_cache = run_case(seed, "cuda" if torch.cuda.is_available() else "cpu")
    assert same_cache and err < 2e-5, err


def _greedy(path, n_prompts=3, max_tokens=4, **kw):
    llm = LLM(path, dtype="float32", max_model_len=128, **kw)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 19, 9, 33, 2, 12)[:n_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()  # the next engine in this process sizes its KV cache from free memory
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_model_greedy_triton_equals_torch_ref(tmp_path, monkeypatch):
    path = make_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TORCH_REF")
    ref = _greedy(path)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    from minivllm.v1.attention.backends import triton_attn
    calls = []
    real = triton_attn.unified_attention
    monkeypatch.setattr(triton_attn, "unified_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert _greedy(path) == ref
    assert len(calls) >= 2 * 4  # 2 layers x (1 prefill step + 3 decode steps) at least


def test_tiny_gemma3_sliding_window_triton_equals_torch_ref(tmp_path, monkeypatch):
    "Gemma 3: sliding-window layers (window 8) next to full ones, two KV cache groups; prompts longer than the window."
    path = make_tiny_checkpoint("gemma3", tmp_path / "gemma3")
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TORCH_REF")
    ref = _greedy(path, n_prompts=2, max_tokens=6)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    assert _greedy(path, n_prompts=2, max_tokens=6) == ref


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_kernels_match_reference(dtype):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for seed in range(8):  # each new shape combination is a Triton compile (~1 s)
        err, same_cache = run_case(seed, "cuda", dtype)
        assert same_cache and err < tol, (seed, err)


@cuda
@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
def test_gpu_greedy_triton_and_cudagraphs_equal_torch_ref(arch, tmp_path, monkeypatch):
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TORCH_REF")
    # small KV pool and scheduler limits: capture sizes 1..16 (min(2 * max_num_seqs, ...)), so decodes of up
    # to 6 requests replay padded graphs, short mixed steps replay FULL graphs, long prompts run eager
    kw = dict(n_prompts=6, max_tokens=24, device="cuda", kv_cache_memory_bytes=1 << 28, max_num_seqs=8,
              max_num_batched_tokens=256)
    ref = _greedy(path, **kw)
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND")  # default on CUDA: Triton
    from minivllm.attention.selector import select_attn_backend_name
    assert select_attn_backend_name("cuda") == "TRITON_ATTN"
    assert _greedy(path, **kw) == ref
    replays = []
    real_replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (replays.append(1), real_replay(self))[1])
    for mode in ("FULL_DECODE_ONLY", "FULL"):
        monkeypatch.setenv("MINIVLLM_CUDAGRAPH_MODE", mode)
        replays.clear()
        assert _greedy(path, **kw) == ref, mode
        assert len(replays) > 0, f"{mode}: no CUDA graph was replayed"
