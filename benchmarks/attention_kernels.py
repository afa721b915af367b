"""Kernel micro-benchmark: paged attention and reshape_and_cache, the kernels vs the torch reference vs SDPA.

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head size 128, bfloat16), block size 16,
block tables shuffled over the pool. Three steps:

- decode: `--batch` requests of one query token each, contexts uniform in [`--ctx-min`, `--ctx-max`];
- prefill: `--num-prompts` prompts of `--prompt-len` tokens, no cached context;
- mixed: half the decode batch plus two prompt chunks of `--prompt-len // 2` after 1024 cached tokens.

For each: the step's kernel (on CUDA the Triton `minivllm_kernels.unified_attention`, one launch for the whole step;
on the CPU the C kernel `minivllm_kernels.cpu_attention.unified_attention_cpu`, one call, timed twice side by side:
on the path `cpu_attention_path` picks with every CPU flag, and on the path it picks with `--old-flags`
(default `avx512f`) hidden through `MINIVLLM_CPU_FLAGS`: the paths before the AVX-512 ones, "old"), the
torch reference backend's
`forward` (minus its K/V write; metadata built once outside the timing, as the runner does once per step
for all layers) and `torch.nn.functional.scaled_dot_product_attention` on the same K/V laid out densely
(no paging; decodes padded to the longest context and masked; prompts as one causal batch). And
`reshape_and_cache` for the step's new tokens, Triton vs the reference's `index_copy_`.

"GB/s" is the minimum traffic (each K/V byte of every request's context read once, queries read, outputs
written; for the cache write: rows read + written) over the median time (CUDA events, `--iters` runs after
warm-up), next to the copy bandwidth measured here (a 1 GiB `copy_`, read + write).

    python benchmarks/attention_kernels.py                  # CUDA if present, else the CPU
    python benchmarks/attention_kernels.py --batch 64 --iters 20
    python benchmarks/attention_kernels.py --device cpu --dtype float32 --batch 64 --ctx-min 200 --ctx-max 330 \
        --num-prompts 4 --prompt-len 256 --iters 10      # SmolLM2-sized work on a small CPU
    python benchmarks/attention_kernels.py --device cpu --heads 9 3 64 --batch 32 --ctx-min 104 \
        --ctx-max 111 --num-prompts 1 --prompt-len 256 --iters 200   # SmolLM2-135M's attention, 32 decodes
(The file is not called kernels.py: a script's folder comes first on sys.path, and a benchmarks/kernels.py
would shadow Hugging Face's `kernels` package, which transformers imports, for every script in this folder.)
"""
from __future__ import annotations

import argparse
import contextlib
import os
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

HQ, HKV, D, BS = 16, 8, 128, 16  # Qwen3-0.6B; --heads changes the first three


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
    n = 1 << 29 if device == "cuda" else 1 << 26  # 1 GiB on a GPU, 128 MiB on the CPU, of bf16
    a, b = torch.zeros(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
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


@contextlib.contextmanager
def flags_hidden(hidden: set[str]):
    "MINIVLLM_CPU_FLAGS showing every flag of this CPU but `hidden`, within the block (read at each call)."
    from minivllm_kernels.cpu_build import cpu_flags
    before = os.environ.get("MINIVLLM_CPU_FLAGS")
    os.environ["MINIVLLM_CPU_FLAGS"] = " ".join(sorted(cpu_flags() - hidden))
    try:
        yield
    finally:
        if before is None:
            del os.environ["MINIVLLM_CPU_FLAGS"]
        else:
            os.environ["MINIVLLM_CPU_FLAGS"] = before


def attention_bytes(query_lens, seq_lens, elem):
    kv = sum(seq_lens) * HKV * D * 2 * elem
    return kv + 2 * sum(query_lens) * HQ * D * elem  # + queries read, outputs written


def run_step(name, query_lens, seq_lens, args, device, dtype, peak):
    if device == "cuda":
        from minivllm_kernels.reshape_and_cache import reshape_and_cache
        from minivllm_kernels.unified_attention import unified_attention
        kernel_label, cache_label = "triton unified_attention", "triton reshape_and_cache"
    else:  # Triton would only run interpreted here: time the C kernel; the cache write is the reference's
        from minivllm_kernels.cpu_attention import unified_attention_cpu as unified_attention
        reshape_and_cache, kernel_label, cache_label = None, "cpu unified_attention_cpu", None
    cm, kv, q, k, v = make_step(query_lens, seq_lens, device, dtype)
    T, elem = cm.num_actual_tokens, kv.element_size()
    md = torch_ref.TorchRefAttentionMetadataBuilder(FullAttentionSpec(BS, HKV, D, dtype), ["l"], None, device).build(0, cm)
    impl = torch_ref.TorchRefAttentionImpl(HQ, D, D ** -0.5, HKV)
    out = torch.empty(T, HQ, D, device=device, dtype=dtype)
    no_write = md.slot_mapping.new_full(md.slot_mapping.shape, -1)
    md_read_only = type(md)(**{**md.__dict__, "slot_mapping": no_write})
    rows = {
        kernel_label: lambda: unified_attention(q.view(T, HQ, D), kv[0], kv[1], out, cm.query_start_loc, cm.seq_lens,
                                                              cm.block_table_tensor, D ** -0.5, cm.max_query_len),
        "torch reference (paged)": lambda: impl.forward(None, q, k, v, kv, md_read_only),
        "torch SDPA (dense, no paging)": sdpa_dense(query_lens, seq_lens, q, dtype, device),
    }
    nbytes = attention_bytes(query_lens, seq_lens, elem)
    print(f"\n{name}: {len(query_lens)} requests, {T} query tokens, {sum(seq_lens)} context tokens, "
          f"{nbytes / 1e6:.1f} MB minimum traffic")
    hidden = {}  # label -> the CPU flags hidden while it is timed
    if device == "cpu":  # the same call, on the path chosen with the newer paths' flags hidden: side by side
        from minivllm_kernels.cpu_attention import cpu_attention_path
        with flags_hidden(set(args.old_flags)):
            old_path = cpu_attention_path(dtype, D)
        kernel = rows.pop(kernel_label)
        new_label = "cpu " + cpu_attention_path(dtype, D).removeprefix("paged_attention_")
        old_label = "cpu " + old_path.removeprefix("paged_attention_") + " (old)"
        rows = {new_label: kernel, old_label: kernel, **rows}
        hidden = {old_label: set(args.old_flags)}
    times = {}
    for label, fn in rows.items():
        with flags_hidden(hidden[label]) if label in hidden else contextlib.nullcontext():
            t = times[label] = bench(fn, args.iters, device)
        print(f"  {label:32s} {t * 1e6:9.1f} us  {nbytes / t / 1e9:8.1f} GB/s  ({100 * nbytes / t / peak:5.1f}% of copy)")
    if hidden:
        t_new, t_old = list(times.values())[:2]
        print(f"  {'old / new':32s} {t_old / t_new:9.2f}x")
    kc, vc = kv[0].clone(), kv[1].clone()
    kk, vv = k.view(T, HKV, D), v.view(T, HKV, D)
    wbytes = 2 * 2 * T * HKV * D * elem
    writers = [("torch reference reshape_and_cache", lambda: torch_ref.reshape_and_cache(kk, vv, kc, vc, cm.slot_mapping))]
    if reshape_and_cache is not None:
        writers.insert(0, (cache_label, lambda: reshape_and_cache(kk, vv, kc, vc, cm.slot_mapping)))
    for label, fn in writers:
        t = bench(fn, args.iters, device)
        print(f"  {label:32s} {t * 1e6:9.1f} us  {wbytes / t / 1e9:8.1f} GB/s  ({100 * wbytes / t / peak:5.1f}% of copy)")


def main() -> None:
    global HQ, HKV, D
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ctx-min", type=int, default=512)
    ap.add_argument("--ctx-max", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available, else cpu")
    ap.add_argument("--heads", type=int, nargs=3, metavar=("HQ", "HKV", "D"), default=[HQ, HKV, D],
                    help="query heads, KV heads, head size (default Qwen3-0.6B's 16 8 128)")
    ap.add_argument("--old-flags", nargs="+", default=["avx512f"],
                    help="CPU flags hidden for the 'old' CPU kernel row (default avx512f: the older paths)")
    args = ap.parse_args()
    HQ, HKV, D = args.heads
    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        from minivllm_kernels.cpu_attention import cpu_attention_available
        if not cpu_attention_available():
            sys.exit("the CPU attention kernel cannot be built here (no C compiler?): nothing to compare")
    rng = random.Random(0)
    torch.manual_seed(0)
    peak = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}  dtype={args.dtype}  heads {HQ}/{HKV}, size {D}", end="  ")
    print(f"copy bandwidth {peak / 1e9:.0f} GB/s (read + write)")
    if device == "cpu":
        from minivllm_kernels.cpu_build import cpu_flags
        isa = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))
        print(f"CPU flags: {isa}; load average {os.getloadavg()}")
    dec_ctx = [rng.randint(args.ctx_min, args.ctx_max) for _ in range(args.batch)]
    run_step("decode", [1] * args.batch, dec_ctx, args, device, dtype, peak)
    run_step("prefill", [args.prompt_len] * args.num_prompts, [args.prompt_len] * args.num_prompts, args, device, dtype, peak)
    half, chunk = dec_ctx[:args.batch // 2], args.prompt_len // 2
    run_step("mixed", [1] * len(half) + [chunk, chunk], half + [1024 + chunk, 1024 + chunk], args, device, dtype, peak)


if __name__ == "__main__":
    main()
