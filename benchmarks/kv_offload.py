"""KV offload, measured: a multi-turn chat workload whose histories do not fit in the KV pool, served with no
connector and with LMCacheConnectorV1 on its CPU tier, CPU + local disk, and CPU + Redis.

    python benchmarks/kv_offload.py [--quick] [--model PATH] [--users 6] [--turns 4] [--chunk-size 256]

Each of `--users` conversations takes `--turns` turns, round robin: a turn sends the whole history plus a new
user message and asks for one token (its wall time is the turn's time to first token, TTFT); then a fixed
synthetic assistant reply is appended to the history, so every setting sees the same token streams. The KV
pool (`--gpu-blocks`) holds about one history, so the engine's own prefix cache mostly misses when the next
user's turn comes: the connector must supply the history. The CPU tier of the "CPU + disk" and "CPU + Redis"
settings is sized to a third of the working set, so the slower tier serves the rest. All engines run in
this process on the CPU (the embedded SmolLM2-135M-Instruct by default); Redis is a private `redis-server`
on a free port (the setting is skipped without one).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none


def _cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0]
    except (OSError, IndexError):
        return platform.processor()
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return " ".join(keep) or "no avx2"


def _start_redis() -> tuple[subprocess.Popen, str] | None:
    if shutil.which("redis-server") is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.01)
    proc.kill()
    return None


def _tokens(seed: int, n: int) -> list[int]:
    "n deterministic pseudo-random token ids (ordinary vocabulary range)."
    return [(seed * 7919 + i * 104729) % 20000 + 200 for i in range(n)]


def _workload(users: int, turns: int, user_tokens: int, reply_tokens: int, system_tokens: int):
    "Per turn (round robin over users): the prompt token ids it sends."
    histories = [_tokens(10_000 + u, system_tokens) for u in range(users)]
    prompts = []
    for t in range(turns):
        for u in range(users):
            histories[u] += _tokens(100 * u + t, user_tokens)
            prompts.append(list(histories[u]))
            histories[u] += _tokens(100 * u + t + 50_000, reply_tokens)
    return prompts


def _serve(model, prompts, kw, kvt=None) -> dict:
    llm = LLM(model, kv_transfer_config=kvt, **kw)
    worker = get_kv_transfer_group_or_none() if kvt else None
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts, reused = [], 0
    t0 = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        ttfts.append(time.perf_counter() - t)
        reused += out.num_cached_tokens or 0
    wall = time.perf_counter() - t0
    stats = worker.storage.stats() if worker is not None else {"hits": {}}
    llm.llm_engine.shutdown()
    total = sum(map(len, prompts))
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else ttfts * 99
    return dict(
        p50=statistics.median(ttfts),
        p99=q[98],
        turns_s=len(prompts) / wall,
        tok_s=total / wall,
        reused=reused / total,
        hits=stats["hits"],
        errors=stats.get("errors", 0),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true", help="3 users x 3 turns, shorter messages")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=96)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--gpu-blocks", type=int, default=None, help="KV pool size (default: about one history)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.quick:
        args.users, args.turns, args.user_tokens, args.reply_tokens = 3, 3, 32, 32
    os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker's store is readable here
    prompts = _workload(args.users, args.turns, args.user_tokens, args.reply_tokens, args.system_tokens)
    longest = max(map(len, prompts))
    bs = 16
    gpu_blocks = args.gpu_blocks or (longest + bs - 1) // bs + 4
    kw = dict(dtype=args.dtype, max_model_len=longest + 16, block_size=bs, num_gpu_blocks_override=gpu_blocks)
    rows = [("no connector", _serve(args.model, prompts, kw))]

    probe = LLM(args.model, **kw)
    mc = probe.llm_engine.vllm_config.model_config
    token_bytes = 2 * mc.get_num_layers() * mc.get_num_kv_heads() * mc.get_head_size() * mc.dtype.itemsize
    probe.llm_engine.shutdown()
    working_set = args.users * longest * token_bytes
    big, small = 4 * working_set / 2**30, working_set / 3 / 2**30

    def kvt(**extra):
        extra = {"chunk_size": args.chunk_size, "local_cpu": True, **extra}
        return {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    rows.append(("CPU tier", _serve(args.model, prompts, kw, kvt(max_local_cpu_size=big))))
    disk = tempfile.mkdtemp(prefix="kv-offload-")
    cfg = kvt(max_local_cpu_size=small, local_disk=disk, max_local_disk_size=big)
    rows.append(("CPU (1/3 of set) + disk", _serve(args.model, prompts, kw, cfg)))
    shutil.rmtree(disk, ignore_errors=True)
    redis = _start_redis()
    if redis is None:
        print("redis-server not found: the CPU + Redis setting is skipped")
    else:
        try:
            cfg = kvt(max_local_cpu_size=small, remote_url=redis[1])
            rows.append(("CPU (1/3 of set) + Redis", _serve(args.model, prompts, kw, cfg)))
        finally:
            redis[0].terminate()
            redis[0].wait()

    print(
        f"{args.users} users x {args.turns} turns, prompts {min(map(len, prompts))}..{longest} tokens "
        f"({sum(map(len, prompts))} in all), KV pool {gpu_blocks} blocks of {bs} "
        f"(~{gpu_blocks * bs} tokens), "
        f"chunk {args.chunk_size}, working set {working_set / 2**20:.0f} MB, dtype {args.dtype}"
    )
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, CPU flags: {_cpu_flags()}")
    head = f"{'setting':26s} {'TTFT p50 ms':>11s} {'p99 ms':>8s} {'turns/s':>8s} {'prompt tok/s':>12s}"
    head += f" {'reused':>7s}"
    print(head + "  chunk hits (CPU / disk / Redis), errors")
    for name, r in rows:
        h = r["hits"]
        hits = " / ".join(
            str(h.get(t, "-")) for t in ("LocalCPUBackend", "LocalDiskBackend", "RemoteBackend")
        )
        print(
            f"{name:26s} {r['p50'] * 1e3:11.1f} {r['p99'] * 1e3:8.1f} {r['turns_s']:8.2f} {r['tok_s']:12.0f} "
            f"{r['reused']:6.0%}  {hits}, {r['errors']}"
        )


if __name__ == "__main__":
    main()
