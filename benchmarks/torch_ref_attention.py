"""TorchRef attention micro-benchmark: one layer's paged attention for decode, prefill and chunked-prefill batches.

Times, per call (median of `--iters`), the metadata builder (once per step), `reshape_and_cache`, and
`TorchRefAttentionImpl.forward` (cache write + attention) for three batches of `--batch` requests on a
SmolLM2-135M-shaped layer (9 query heads, 3 KV heads, head size 64, blocks of 16):
decodes at context `--context`; fresh prefills of `--prompt` tokens; chunks of `--prompt // 2` tokens after
`--context` cached tokens. Run it on `--device cuda` to compare with the Triton kernels later; no timing is
asserted anywhere.

    python benchmarks/torch_ref_attention.py
    python benchmarks/torch_ref_attention.py --batch 32 --context 1024 --dtype bfloat16 --threads 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.testing import make_common_attn_metadata
from minivllm.v1.attention.backends.torch_ref import TorchRefAttentionBackend, reshape_and_cache
from minivllm.v1.kv_cache_interface import FullAttentionSpec


def timeit(fn, iters: int, device: torch.device) -> float:
    "Median seconds per call."
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda": torch.cuda.synchronize()
        t = time.perf_counter(); fn()
        if device.type == "cuda": torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    Hq, Hkv, D, bs = 9, 3, 64, 16
    per_req = -(-(args.context + args.prompt) // bs)
    num_blocks = args.batch * per_req
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g).view(args.batch, per_req).tolist()
    kv = torch.randn(2, num_blocks, bs, Hkv, D, generator=g).to(dev, dtype)
    spec = FullAttentionSpec(bs, Hkv, D, dtype)
    builder = TorchRefAttentionBackend.get_builder_cls()(spec, ["layer"], None, dev)
    impl = TorchRefAttentionBackend.get_impl_cls()(Hq, D, D ** -0.5, Hkv)
    B, C, P = args.batch, args.context, args.prompt
    cases = {f"decode   {B} x 1 @ ctx {C}": ([1] * B, [C + 1] * B),
             f"prefill  {B} x {P}": ([P] * B, [P] * B),
             f"chunk    {B} x {P // 2} @ ctx {C}": ([P // 2] * B, [C + P // 2] * B)}
    print(f"TorchRef attention, {args.device} {args.dtype}, {args.threads} thread(s), Hq={Hq} Hkv={Hkv} D={D} block={bs}")
    for name, (qlens, slens) in cases.items():
        cm = make_common_attn_metadata(qlens, slens, tables, bs, dev)
        T = cm.num_actual_tokens
        q = torch.randn(T, Hq * D, generator=g).to(dev, dtype)
        k, v = (torch.randn(T, Hkv * D, generator=g).to(dev, dtype) for _ in range(2))
        md = builder.build(0, cm)
        t_build = timeit(lambda: builder.build(0, cm), args.iters, dev)
        t_cache = timeit(lambda: reshape_and_cache(k.view(T, Hkv, D), v.view(T, Hkv, D), kv[0], kv[1], cm.slot_mapping), args.iters, dev)
        t_fwd = timeit(lambda: impl.forward(None, q, k, v, kv, md), args.iters, dev)
        print(f"{name:<28} build {t_build * 1e6:8.0f} us   reshape_and_cache {t_cache * 1e6:7.0f} us   "
              f"forward {t_fwd * 1e6:8.0f} us   ({T / t_fwd:,.0f} tokens/s per layer)")


if __name__ == "__main__":
    main()
