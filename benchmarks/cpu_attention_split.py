"""The CPU attention kernel alone, before and after a change (issue 31 item 3: the split, AVX-512 paths).

"before" is `minivllm_kernels/cpu_attention.py` as of git revision `--baseline` (default 689e33c: the kernel before
the AVX-512 paths, with the AVX512-BF16 dot products per token and the AVX2 float32 path), built here under
its own name; "after" is the working tree's kernel, once with every CPU flag and once with `avx512_bf16`
hidden from its path choice (on an AVX-512 CPU: the AVX-512 path with K and V widened to float32).
Each case times one call on the same random paged cache:

- decode 1: one decoding sequence (a single stream), 4096 cached tokens;
- decode 1, 2000: one sequence of 2000;
- decode 32: thirty-two sequences of 104-111 (SmolLM2's 32-sequence decode);
- decode 16: sixteen sequences of 1024;
- prefill 256: one 256-token prompt.

for bfloat16 and float32, head sizes 64 and 128 (9 query heads over 3 KV heads, SmolLM2's grouping), with 1
and with 2 OpenMP threads. A time is the fastest of `--iters` calls after warm-up: on a shared machine a
median catches the 4 ms scheduler ticks of a preempted OpenMP thread, the minimum is the kernel's own cost.
Ratios are before / after (above 1: faster now). Prints the CPU flags and the load average around the run
(run it on a quiet machine).

    python benchmarks/cpu_attention_split.py [--baseline 689e33c] [--iters 30] [--threads 1 2] [--median]
        [--cases "decode 32" "decode 1,"] [--head-sizes 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

import minivllm_kernels.cpu_attention as after  # noqa: E402
from minivllm_kernels.cpu_build import cpu_flags  # noqa: E402
from minivllm.testing import make_common_attn_metadata  # noqa: E402


def baseline_module(rev: str) -> types.ModuleType:
    "minivllm_kernels/cpu_attention.py at `rev`, imported as its own module (its library gets its own cache file)."
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:minivllm_kernels/cpu_attention.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    mod = types.ModuleType("minivllm_kernels._cpu_attention_baseline")
    mod.__package__ = "minivllm_kernels"
    exec(compile(text, f"{rev}:minivllm_kernels/cpu_attention.py", "exec"), mod.__dict__)
    return mod


def case(name: str, query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, D: int):
    g = torch.Generator().manual_seed(0)
    bs, Hkv, Hq = 16, 3, 9
    need = [-(-s // bs) for s in seq_lens]
    nb = sum(need) + 4
    free = torch.randperm(nb, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    cm = make_common_attn_metadata(query_lens, seq_lens, tables, bs)
    kv = torch.randn(2, nb, bs, Hkv, D, generator=g).to(dtype)
    q = torch.randn(cm.num_actual_tokens, Hq, D, generator=g).to(dtype)
    return name, (q, kv[0], kv[1], cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, D**-0.5)


def time_call(fn, args, iters: int, threads: int, median: bool = False) -> float:
    "Fastest (or, with `median`, the median) of `iters` calls, in ms."
    q, kc, vc, qsl, sl, bt, scale = args
    out = torch.empty_like(q)
    for _ in range(3):
        fn(q, kc, vc, out, qsl, sl, bt, scale, num_threads=threads)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(q, kc, vc, out, qsl, sl, bt, scale, num_threads=threads)
        ts.append(time.perf_counter() - t)
    return (sorted(ts)[len(ts) // 2] if median else min(ts)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="689e33c", help="git revision of the kernel to compare with")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--median", action="store_true", help="report medians instead of minima")
    ap.add_argument(
        "--cases", nargs="+", default=None, help="only the cases whose name starts with one of these"
    )
    ap.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args()
    before = baseline_module(args.baseline)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    stat = "median" if args.median else "fastest"
    print(f"CPU flags: {' '.join(flags)}; load {os.getloadavg()}; times: the {stat} of {args.iters} calls")
    print(f"{'case':40s} {'before':>9s} {'after':>9s} {'ratio':>6s} {'no-bf16':>9s} {'ratio':>6s}  path")
    no_dp = " ".join(f for f in cpu_flags() if f != "avx512_bf16")
    for threads in args.threads:
        for dtype in (torch.bfloat16, torch.float32):
            for D in args.head_sizes:
                cases = [
                    case("decode 1", [1], [4096], dtype, D),
                    case("decode 1, 2000", [1], [2000], dtype, D),
                    case("decode 32, 104-111", [1] * 32, [104 + i % 8 for i in range(32)], dtype, D),
                    case("decode 16", [1] * 16, [1024] * 16, dtype, D),
                    case("prefill 256", [256], [256], dtype, D),
                ]
                for name, call in cases:
                    if args.cases and not name.startswith(tuple(args.cases)):
                        continue
                    t_before = time_call(before.unified_attention_cpu, call, args.iters, threads, args.median)
                    t_after = time_call(after.unified_attention_cpu, call, args.iters, threads, args.median)
                    path = after.cpu_attention_path(dtype, D)
                    old_path = before.cpu_attention_path(dtype, D)
                    os.environ["MINIVLLM_CPU_FLAGS"] = no_dp
                    try:
                        t_hidden = time_call(
                            after.unified_attention_cpu, call, args.iters, threads, args.median
                        )
                    finally:
                        del os.environ["MINIVLLM_CPU_FLAGS"]
                    label = f"{name}, {str(dtype)[6:]}, D={D}, {threads} thr"
                    print(
                        f"{label:40s} {t_before:8.3f}ms {t_after:8.3f}ms {t_before / t_after:6.2f} "
                        f"{t_hidden:8.3f}ms {t_before / t_hidden:6.2f}  {path} ({old_path})"
                    )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
