"""The linears of one SmolLM2-135M forward (121 matmuls: 30 layers x qkv, o, gate_up, down, plus the LM head)
at decode and prefill row counts, through F.linear, oneDNN's prepacked matmul and minivllm_kernels.cpu_gemm, side by
side: milliseconds per forward, weight GB/s and GFLOP/s, and the ratio to oneDNN. It is the measurement behind
`minivllm_kernels.cpu_gemm.use_cpu_gemm`'s default; run it on a new CPU to check that policy.

    python benchmarks/cpu_gemm.py [--rows 1 2 4 8 32 128 512] [--dtype float32 bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minivllm_kernels.cpu_build import cpu_flags  # noqa: E402
from minivllm_kernels.cpu_gemm import cpu_gemm, load_cpu_gemm_lib, pack_weight, use_cpu_gemm  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # (N, K) of SmolLM2-135M


def run_plain(ws, xs, packed):
    for w in ws:
        torch.nn.functional.linear(xs[w.shape[1]], w)


def run_onednn(ws, xs, packed):
    for w, p in zip(ws, packed):
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")


def run_cpu_gemm(ws, xs, packed):
    for w, p in zip(ws, packed):
        cpu_gemm(xs[w.shape[1]], p, w.shape[0])


def best_ms(run, ws, xs, reps: int, packed=None) -> float:
    "The fastest of `reps` runs of all the linears after one warm-up, in ms."
    run(ws, xs, packed)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run(ws, xs, packed)
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128, 512, 2048])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
    print(f"CPU flags: {flags}; {args.threads} threads; cpu_gemm built: {load_cpu_gemm_lib() is not None}")
    g = torch.Generator().manual_seed(0)
    for name in args.dtype:
        dtype = getattr(torch, name)
        ws = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        try:
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        except RuntimeError:
            onednn = None  # oneDNN packs bfloat16 only with AVX512-BF16 / AVX-NE-CONVERT: its column is nan
        panels = [pack_weight(w) for w in ws] if load_cpu_gemm_lib() is not None else None
        print(f"\n{name}: {nbytes / 1e6:.0f} MB of weights; use_cpu_gemm -> {use_cpu_gemm(dtype)}")
        head = f"{'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'cpu_gemm ms':>12} {'GB/s':>6}"
        print(head, f"{'GFLOP/s':>8} {'oneDNN/cpu_gemm':>15}")
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (576, 1536)}
            slow = dtype == torch.bfloat16 and onednn is None and m > 4  # torch's emulated bfloat16: minutes
            plain = float("nan") if slow else best_ms(run_plain, ws, xs, args.reps)
            dnn = float("nan") if onednn is None else best_ms(run_onednn, ws, xs, args.reps, onednn)
            ours = float("nan") if panels is None else best_ms(run_cpu_gemm, ws, xs, args.reps, panels)
            flops = 2 * m * sum(w.numel() for w in ws)
            print(
                f"{m:>5} {plain:>12.2f} {dnn:>10.2f} {ours:>12.2f} {nbytes / ours / 1e6:>6.1f} "
                f"{flops / ours / 1e6:>8.1f} {dnn / ours:>15.2f}"
            )


if __name__ == "__main__":
    main()
