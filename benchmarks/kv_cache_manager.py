"""KVCacheManager micro-benchmark: allocate / cache-hit / free throughput on a synthetic trace.

Trace (fixed seed): `--num-requests` requests, each one of `--num-prefixes` shared "system prompts"
(lengths uniform in [256, 1024] tokens) followed by a unique suffix (uniform in [16, 512] tokens).
Requests are admitted in order, as a scheduler would: prefix-cache lookup (`get_computed_blocks`),
prefill allocation (`allocate_slots` for the uncached tokens), then `--decode-tokens` decode steps
(append a token, `allocate_slots(request, 1)`); at most `--max-running` requests run at once and the
oldest is freed (`free`) when a new one needs room. The pool (`--num-blocks`) is smaller than the
trace's working set, so cached blocks get evicted and reused. Block hashing (done by `Request` via
the block hasher) is timed separately. Prints calls, ops/s and µs/call per operation and the hit rate.

vLLM's own KVCacheManager is not run side by side: the `vllm` wheels on PyPI are CUDA builds with
torch pinned to another version (installing one would replace this venv's torch), the CPU build is
not published as a small wheel (it is built from source), and this machine has no network beyond
PyPI nor time for a source build. So only minivllm's figures are printed.

    python benchmarks/kv_cache_manager.py
    python benchmarks/kv_cache_manager.py --num-requests 2000 --hash-algo xxhash
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--num-prefixes", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--hash-algo", default="sha256_cbor", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from minivllm.sampling_params import SamplingParams
    from minivllm.v1.core.kv_cache_manager import KVCacheManager
    from minivllm.v1.core.kv_cache_utils import get_hash_fn_by_name, get_request_block_hasher, init_none_hash
    from minivllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from minivllm.v1.request import Request

    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randint(256, 1024))] for _ in range(args.num_prefixes)]
    prompts = [prefixes[rng.randrange(args.num_prefixes)] + [rng.randrange(32000) for _ in range(rng.randint(16, 512))]
               for _ in range(args.num_requests)]
    max_model_len = max(map(len, prompts)) + args.decode_tokens + 1

    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=args.num_blocks, kv_cache_tensors=[KVCacheTensor(0, ["layer.0"])],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    hash_fn = get_hash_fn_by_name(args.hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(args.block_size, hash_fn)
    kvm = KVCacheManager(kv_cache_config=config, max_model_len=max_model_len, enable_caching=True,
                         hash_block_size=args.block_size, log_stats=True)
    sp = SamplingParams(max_tokens=args.decode_tokens)

    ns: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)
    def timed(name, fn, *a, **kw):
        t = time.perf_counter_ns(); out = fn(*a, **kw); ns[name] += time.perf_counter_ns() - t; calls[name] += 1
        return out

    running: deque = deque()
    preempted = 0
    wall = time.perf_counter()
    for i, prompt in enumerate(prompts):
        req = timed("hash (Request + block hasher)", Request, f"r{i}", prompt, sp, block_hasher=hasher)
        while True:
            hit, n = timed("get_computed_blocks", kvm.get_computed_blocks, req)
            blocks = timed("allocate_slots (prefill)", kvm.allocate_slots, req, req.num_tokens - n, n, hit)
            if blocks is not None: break
            if not running: raise SystemExit("pool too small for one request: raise --num-blocks")
            timed("free", kvm.free, running.popleft()); preempted += 1
        req.num_computed_tokens = req.num_tokens
        running.append(req)
        for _ in range(args.decode_tokens):
            req.append_output_token_ids(rng.randrange(32000))
            if timed("allocate_slots (decode)", kvm.allocate_slots, req, 1) is None:
                timed("free", kvm.free, running.popleft()); preempted += 1
                continue
            req.num_computed_tokens += 1
        if len(running) > args.max_running:
            timed("free", kvm.free, running.popleft())
    while running: timed("free", kvm.free, running.popleft())
    wall = time.perf_counter() - wall

    stats = kvm.make_prefix_cache_stats()
    print(f"minivllm KVCacheManager: {args.num_requests} requests, {sum(map(len, prompts))} prompt tokens, "
          f"block_size {args.block_size}, {args.num_blocks} blocks, hash {args.hash_algo}")
    print(f"prefix-cache hit rate {stats.hits / max(stats.queries, 1):.1%} ({stats.hits} of {stats.queries} tokens); "
          f"frees forced by a full pool: {preempted}; wall {wall:.2f} s")
    print(f"{'operation':32s} {'calls':>8s} {'ops/s':>12s} {'µs/call':>10s}")
    for name in ("hash (Request + block hasher)", "get_computed_blocks", "allocate_slots (prefill)",
                 "allocate_slots (decode)", "free"):
        c, t = calls[name], ns[name] / 1e9
        print(f"{name:32s} {c:8d} {c / t if t else 0:12,.0f} {t / c * 1e6 if c else 0:10.1f}")
    print("vLLM's KVCacheManager was not run alongside: its PyPI wheels are CUDA builds pinning another torch and "
          "the CPU build needs a source build (see the module docstring).")


if __name__ == "__main__":
    main()
