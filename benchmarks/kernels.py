"""Kernel micro-benchmark: paged attention and reshape_and_cache, Triton vs the torch reference vs SDPA.

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head size 128, bfloat16), block size 16,
block tables shuffled over the pool. Three steps:

- decode: `--batch` requests of one query token each, contexts uniform in [`--ctx-min`, `--ctx-max`];
- prefill: `--num-prompts` prompts of `--prompt-len` tokens, no cached context;
- mixed: half the decode batch plus two prompt chunks of `--prompt-len // 2` after 1024 cached tokens.

For each: `kernels.unified_attention` (one launch for the whole step), the torch reference backend's
`forward` (minus its K/V write; metadata built once outside the timing, as the runner does once per step
for all layers) and `torch.nn.functional.scaled_dot_product_attention` on the same K/V laid out densely
(no paging; decodes padded to the longest context and masked; prompts as one causal batch). And
`reshape_and_cache` for the step's new tokens, Triton vs the reference's `index_copy_`.

"GB/s" is the minimum traffic (each K/V byte of every request's context read once, queries read, outputs
written; for the cache write: rows read + written) over the median time (CUDA events, `--iters` runs after
warm-up), next to the copy bandwidth measured here (a 1 GiB device-to-device `copy_`, read + write).

    python benchmarks/kernels.py                  # on a CUDA machine
    python benchmarks/kernels.py --batch 64 --iters 20
On a machine without CUDA it says so and times the torch reference alone on a small decode step.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minivllm.testing import make_common_attn_metadata  # noqa: E402
from minivllm.v1.attention.backends import torch_ref  # noqa: E402
from minivllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16


def bench(fn, iters: int, device: str) -> float:
    "Median seconds per call."
    for _ in range(3): fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); fn(); end.record(); torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    "Bytes/s of a device-to-device copy (read + write counted)."
    n = 1 << 29  # 1 GiB of bf16
    a, b = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    return 2 * a.numel() * a.element_size() / bench(lambda: b.copy_(a), 10, device)


def make_step(query_lens, seq_lens, device, dtype, seed=0):
    "Paged cache filled with random K/V, the step's metadata, queries and new K/V."
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in need]
    cm = make_common_attn_metadata(query_lens, seq_lens, tables, BS, device=device)
    kv = torch.randn(2, num_blocks, BS, HKV, D, device=device, dtype=dtype)
    T = cm.num_actual_tokens
    q = torch.randn(T, HQ * D, device=device, dtype=dtype)
    k, v = torch.randn(T, HKV * D, device=device, dtype=dtype), torch.randn(T, HKV * D, device=device, dtype=dtype)
    return cm, kv, q, k, v


def sdpa_dense(query_lens, seq_lens, q, dtype, device):
    "A callable running SDPA on densely laid-out K/V of the same shapes (no paging)."
    decodes = [i for i, ql in enumerate(query_lens) if ql == 1]
    prompts = [i for i, ql in enumerate(query_lens) if ql > 1]
    calls = []
    if decodes:
        L = max(seq_lens[i] for i in decodes)
        kd = torch.randn(len(decodes), HKV, L, D, device=device, dtype=dtype)
        vd = torch.randn_like(kd)
        qd = torch.randn(len(decodes), HQ, 1, D, device=device, dtype=dtype)
        mask = (torch.arange(L, device=device)[None] < torch.tensor([seq_lens[i] for i in decodes], device=device)[:, None])
        mask = mask[:, None, None, :]
        calls.append(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))
    for i in prompts:  # prompts of one length batch together
        ql, ctx = query_lens[i], seq_lens[i] - query_lens[i]
        qp = torch.randn(1, HQ, ql, D, device=device, dtype=dtype)
        kp = torch.randn(1, HKV, seq_lens[i], D, device=device, dtype=dtype)
        vp = torch.randn_like(kp)
        if ctx == 0:
            calls.append(lambda qp=qp, kp=kp, vp=vp: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True))
        else:
            m = torch.arange(seq_lens[i], device=device)[None] <= torch.arange(ctx, seq_lens[i], device=device)[:, None]
            calls.append(lambda qp=qp, kp=kp, vp=vp, m=m: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=m, enable_gqa=True))
    return lambda: [c() for c in calls]


def attention_bytes(query_lens, seq_lens, elem):
    kv = sum(seq_lens) * HKV * D * 2 * elem
    return kv + 2 * sum(query_lens) * HQ * D * elem  # + queries read, outputs written


def run_step(name, query_lens, seq_lens, args, device, dtype, peak):
    from kernels.reshape_and_cache import reshape_and_cache
    from kernels.unified_attention import unified_attention
    cm, kv, q, k, v = make_step(query_lens, seq_lens, device, dtype)
    T, elem = cm.num_actual_tokens, kv.element_size()
    md = torch_ref.TorchRefAttentionMetadataBuilder(FullAttentionSpec(BS, HKV, D, dtype), ["l"], None, device).build(0, cm)
    impl = torch_ref.TorchRefAttentionImpl(HQ, D, D ** -0.5, HKV)
    out = torch.empty(T, HQ, D, device=device, dtype=dtype)
    no_write = md.slot_mapping.new_full(md.slot_mapping.shape, -1)
    md_read_only = type(md)(**{**md.__dict__, "slot_mapping": no_write})
    rows = {
        "triton unified_attention": lambda: unified_attention(q.view(T, HQ, D), kv[0], kv[1], out, cm.query_start_loc, cm.seq_lens,
                                                              cm.block_table_tensor, D ** -0.5, cm.max_query_len),
        "torch reference (paged)": lambda: impl.forward(None, q, k, v, kv, md_read_only),
        "torch SDPA (dense, no paging)": sdpa_dense(query_lens, seq_lens, q, dtype, device),
    }
    nbytes = attention_bytes(query_lens, seq_lens, elem)
    print(f"\n{name}: {len(query_lens)} requests, {T} query tokens, {sum(seq_lens)} context tokens, "
          f"{nbytes / 1e6:.1f} MB minimum traffic")
    for label, fn in rows.items():
        t = bench(fn, args.iters, device)
        print(f"  {label:32s} {t * 1e6:9.1f} us  {nbytes / t / 1e9:8.1f} GB/s  ({100 * nbytes / t / peak:5.1f}% of copy)")
    kc, vc = kv[0].clone(), kv[1].clone()
    kk, vv = k.view(T, HKV, D), v.view(T, HKV, D)
    wbytes = 2 * 2 * T * HKV * D * elem
    for label, fn in (("triton reshape_and_cache", lambda: reshape_and_cache(kk, vv, kc, vc, cm.slot_mapping)),
                      ("torch reference reshape_and_cache", lambda: torch_ref.reshape_and_cache(kk, vv, kc, vc, cm.slot_mapping))):
        t = bench(fn, args.iters, device)
        print(f"  {label:32s} {t * 1e6:9.1f} us  {wbytes / t / 1e9:8.1f} GB/s  ({100 * wbytes / t / peak:5.1f}% of copy)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ctx-min", type=int, default=512)
    ap.add_argument("--ctx-max", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs CUDA for the Triton kernels (on the CPU they only run in Triton's "
              "interpreter, which is for tests, not timing). Timing the torch reference alone on a small decode step:")
        ctx = [rng.randint(64, 256) for _ in range(16)]
        cm, kv, q, k, v = make_step([1] * 16, ctx, "cpu", torch.float32)
        md = torch_ref.TorchRefAttentionMetadataBuilder(FullAttentionSpec(BS, HKV, D, torch.float32), ["l"], None, "cpu").build(0, cm)
        impl = torch_ref.TorchRefAttentionImpl(HQ, D, D ** -0.5, HKV)
        t = bench(lambda: impl.forward(None, q, k, v, kv, md), 5, "cpu")
        print(f"  torch reference, 16 decodes, {sum(ctx)} context tokens: {t * 1e3:.2f} ms per layer")
        return
    torch.manual_seed(0)
    peak = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype}  copy bandwidth {peak / 1e9:.0f} GB/s (read + write)")
    dec_ctx = [rng.randint(args.ctx_min, args.ctx_max) for _ in range(args.batch)]
    run_step("decode", [1] * args.batch, dec_ctx, args, "cuda", dtype, peak)
    run_step("prefill", [args.prompt_len] * args.num_prompts, [args.prompt_len] * args.num_prompts, args, "cuda", dtype, peak)
    half, chunk = dec_ctx[:args.batch // 2], args.prompt_len // 2
    run_step("mixed", [1] * len(half) + [chunk, chunk], half + [1024 + chunk, 1024 + chunk], args, "cuda", dtype, peak)


if __name__ == "__main__":
    main()
