"""A decode step's elementwise layers on the CPU: the torch code (`forward_native`) vs the fused C kernels (`forward_cpu`).

Times each `CustomOp` layer through its normal `forward` (dispatch and launcher checks included), built once
with `custom_ops=["none"]` (torch) and once with `["all"]` (kernels on, the default), at SmolLM2-135M's sizes for a 64-request
decode step: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64. Prints microseconds per call, the
ratio, and the total per step (30 layers: 2 residual norms, 1 SiLU-and-mul, 1 RoPE each, plus the final norm).

    python benchmarks/custom_ops.py                      # float32 and bfloat16, torch's thread count
    python benchmarks/custom_ops.py --tokens 256 --threads 1 --dtype float32
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from minivllm.compilation_config import CompilationConfig
from minivllm.config import DeviceConfig, set_current_vllm_config
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding


def bench_us(f, n: int, repeats: int = 7) -> float:
    "Best of `repeats` means over n calls, in microseconds (the machine may be shared: the minimum is the steadiest)."
    for _ in range(max(3, n // 10)): f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def build(custom_ops: list[str], dtype: torch.dtype, a) -> dict:
    cfg = SimpleNamespace(compilation_config=CompilationConfig(custom_ops=custom_ops), device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(cfg):
        norm = RMSNorm(a.hidden, eps=1e-5, dtype=dtype)
        act = SiluAndMul()
        rope = RotaryEmbedding(a.head_size, a.head_size, 8192, 10000.0, True, dtype)
    with torch.no_grad(): norm.weight.uniform_(0.5, 1.5)
    return dict(norm=norm, act=act, rope=rope)


def cases(layers: dict, dtype: torch.dtype, a, g: torch.Generator) -> dict:
    T, H, I, D = a.tokens, a.hidden, a.intermediate, a.head_size
    x, res = (torch.randn(T, H, generator=g).to(dtype) for _ in range(2))
    gate_up = torch.randn(T, 2 * I, generator=g).to(dtype)
    qkv = torch.randn(T, (a.heads + 2 * a.kv_heads) * D, generator=g).to(dtype)
    q, k = qkv[:, :a.heads * D], qkv[:, a.heads * D:(a.heads + a.kv_heads) * D]  # strided views, as in the model
    pos = torch.randint(0, 8192, (T,), generator=g)
    n, act, rope = layers["norm"], layers["act"], layers["rope"]
    return {"rms_norm": lambda: n(x),
            "fused_add_rms_norm": lambda: n(x, res),
            "silu_and_mul": lambda: act(gate_up),
            "rotary_embedding": lambda: rope(pos, q, k)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch and kernel threads (default: torch's)")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    if a.threads: torch.set_num_threads(a.threads)
    from minivllm_kernels.cpu_ops import cpu_ops_available
    if not cpu_ops_available(): raise SystemExit("the fused CPU ops cannot be built here (no C compiler?)")
    # per step: layer 0 input norm without residual; 2 residual norms per layer after it, minus 1, plus the final norm
    per_step = {"rms_norm": 1, "fused_add_rms_norm": 2 * a.layers, "silu_and_mul": a.layers, "rotary_embedding": a.layers}
    print(f"{a.tokens} tokens, hidden {a.hidden}, intermediate {a.intermediate}, {a.heads}/{a.kv_heads} heads of {a.head_size}, "
          f"{torch.get_num_threads()} threads")
    with torch.inference_mode():
        for dname in a.dtype:
            dtype = getattr(torch, dname)
            g = torch.Generator().manual_seed(0)
            native, fused = build(["none"], dtype, a), build(["all"], dtype, a)
            assert native["norm"]._forward_method.__name__ == "forward_native"
            assert fused["norm"]._forward_method.__name__ == "forward_cpu"
            cn, cf = cases(native, dtype, a, g), cases(fused, dtype, a, g)
            print(f"\n{dname:9s} {'op':20s} {'torch us':>9s} {'C us':>8s} {'ratio':>6s} {'calls/step':>10s}")
            tot_n = tot_f = 0.0
            for op in cn:
                tn, tf = bench_us(cn[op], a.iters), bench_us(cf[op], a.iters)
                tot_n += tn * per_step[op]; tot_f += tf * per_step[op]
                print(f"{'':9s} {op:20s} {tn:9.1f} {tf:8.1f} {tn / tf:5.1f}x {per_step[op]:10d}")
            print(f"{'':9s} {'per decode step':20s} {tot_n / 1e3:8.2f}ms {tot_f / 1e3:6.2f}ms {tot_n / tot_f:5.1f}x")


if __name__ == "__main__":
    main()
