"""TorchRef paged attention against dense float64 attention on random mixed batches.

Each case draws a batch of decodes and prefills (with or without cached context), a block size, a GQA ratio,
an optional sliding window and soft cap, shuffled block tables and padding tokens (slot -1). It checks:
the output equals dense causal attention over each request's full K/V; exactly the scheduled slots of the
cache changed, to the new K/V; padding rows of the output are zero.
"""
import random

import pytest
import torch

from minivllm.testing import make_common_attn_metadata
from minivllm.v1.attention.backends.torch_ref import TorchRefAttentionBackend, reshape_and_cache
from minivllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec


def dense(q, k, v, ctx, scale, window, soft_cap):
    "q: (Lq, Hq, D) at positions ctx.. ; k, v: (ctx + Lq, Hkv, D) -> (Lq, Hq, D) float64."
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if soft_cap: s = soft_cap * torch.tanh(s / soft_cap)
    qp, kp = torch.arange(ctx, ctx + q.shape[0])[:, None], torch.arange(k.shape[0])[None]
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v.double().repeat_interleave(g, 1))


@pytest.mark.parametrize("seed", range(40))
def test_random_mixed_batch(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = rng.choice([1, 4, 16])
    Hkv, ratio, D = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([8, 16])
    Hq = Hkv * ratio
    window = rng.choice([None, None, 5, 17])
    soft_cap = rng.choice([None, None, 5.0])
    num_reqs = rng.randint(1, 6)
    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        if rng.random() < 0.5: ctx, q = rng.randint(0, 60), 1                   # decode (or a 1-token prompt)
        else: ctx, q = rng.choice([0, 0, rng.randint(1, 40)]), rng.randint(2, 30)  # prefill, maybe after a cached prefix
        query_lens.append(q); seq_lens.append(ctx + q)
    need = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(need) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    pad = rng.randint(0, 3)
    cm = make_common_attn_metadata(query_lens, seq_lens, tables, bs, pad_tokens=pad)

    kv = torch.randn(2, num_blocks, bs, Hkv, D, generator=g)
    full_k = [torch.randn(s, Hkv, D, generator=g) for s in seq_lens]
    full_v = [torch.randn(s, Hkv, D, generator=g) for s in seq_lens]
    for r, s in enumerate(seq_lens):
        for p in range(s - query_lens[r]):
            kv[0, tables[r][p // bs], p % bs], kv[1, tables[r][p // bs], p % bs] = full_k[r][p], full_v[r][p]
    T = cm.num_actual_tokens + pad
    new = lambda full: torch.cat([f[s - q:] for f, s, q in zip(full, seq_lens, query_lens)] + [torch.randn(pad, Hkv, D, generator=g)])
    key, value = new(full_k).view(T, -1), new(full_v).view(T, -1)
    query = torch.randn(T, Hq * D, generator=g)

    spec = SlidingWindowSpec(bs, Hkv, D, torch.float32, sliding_window=window) if window else FullAttentionSpec(bs, Hkv, D, torch.float32)
    md = TorchRefAttentionBackend.get_builder_cls()(spec, ["l"], None, "cpu").build(0, cm)
    impl = TorchRefAttentionBackend.get_impl_cls()(Hq, D, D ** -0.5, Hkv, sliding_window=window, logits_soft_cap=soft_cap)
    before = kv.clone()
    out = impl.forward(None, query, key, value, kv, md)

    written = cm.slot_mapping[cm.slot_mapping >= 0]
    changed = (kv != before).view(2, -1, Hkv * D).any(-1).any(0).nonzero().flatten()
    assert set(changed.tolist()) <= set(written.tolist())
    assert torch.equal(kv[0].view(-1, Hkv, D)[written], key[:cm.num_actual_tokens].view(-1, Hkv, D))
    assert torch.equal(out[cm.num_actual_tokens:], torch.zeros(pad, Hq * D))
    qsl = cm.query_start_loc_cpu.tolist()
    for r, s in enumerate(seq_lens):
        ref = dense(query[qsl[r]:qsl[r + 1]].view(-1, Hq, D), full_k[r], full_v[r], s - query_lens[r], D ** -0.5, window, soft_cap)
        err = (out[qsl[r]:qsl[r + 1]].view(-1, Hq, D).double() - ref).abs().max().item()
        assert err < 1e-5, f"request {r} (q={query_lens[r]}, seq={s}, window={window}): max error {err}"


def test_reshape_and_cache_skips_padding_slots():
    kc, vc = torch.zeros(4, 2, 1, 3), torch.zeros(4, 2, 1, 3)
    k = torch.arange(12.).view(4, 1, 3)
    reshape_and_cache(k, k + 100, kc, vc, torch.tensor([7, -1, 0, -1]))
    flat = kc.view(8, 3)
    assert flat[7].tolist() == [0., 1., 2.] and flat[0].tolist() == [6., 7., 8.]
    assert flat[1:7].abs().sum() == 0 and torch.equal(vc.view(8, 3)[7], flat[7] + 100)
