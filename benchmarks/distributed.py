"""Tensor parallelism on the CPU: per-step all-reduce time and bytes at TP=2 beside the TP=1 step time.

Both configurations run through `MultiprocExecutor` (worker processes, gloo), so the step time is measured the
same way: inside rank 0's `Worker.execute_model` (forward + logits, no scheduling or IPC). For TP=2 each
worker also times every TP all-reduce / all-gather and counts its payload bytes. Workload (fixed seed):
N prompts of random token ids, greedy, EOS ignored; prefill and decode steps are reported apart.

    python benchmarks/distributed.py                       # a Llama of width 512, 4 layers, float32
    python benchmarks/distributed.py --hidden-size 1024 --num-layers 8 --num-prompts 16 --output-len 32
    python benchmarks/distributed.py --device cuda --tp 1 2 4   # NCCL, on a machine with several GPUs

On a 2-core CPU, TP=2 mostly measures the communication: both workers share the same cores, so the
matmuls are not faster and the all-reduces are added on top.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def install_probes(worker) -> None:
    """In a worker process: time `execute_model` and the TP collectives, count their bytes (runs by RPC)."""
    from minivllm.distributed import parallel_state
    from minivllm.v1.worker import gpu_worker

    stats = {"steps": [], "comm": []}  # per step: (tokens, seconds); per step: [(op, bytes, seconds)]
    worker._bench_stats = stats
    cls = parallel_state.GroupCoordinator

    def timed(op, orig):
        def wrapper(self, input_, *args, **kwargs):
            if self.world_size == 1:
                return orig(self, input_, *args, **kwargs)
            t = time.perf_counter()
            out = orig(self, input_, *args, **kwargs)
            if stats["comm"]:
                stats["comm"][-1].append(
                    (op, input_.numel() * input_.element_size(), time.perf_counter() - t)
                )
            return out

        return wrapper

    cls.all_reduce = timed("all_reduce", cls.all_reduce)
    cls.all_gather = timed("all_gather", cls.all_gather)
    orig_exec = gpu_worker.Worker.execute_model

    def execute_model(self, scheduler_output):
        stats["comm"].append([])
        t = time.perf_counter()
        out = orig_exec(self, scheduler_output)
        stats["steps"].append((scheduler_output.total_num_scheduled_tokens, time.perf_counter() - t))
        return out

    gpu_worker.Worker.execute_model = execute_model


def read_probes(worker) -> dict:
    return worker._bench_stats


def run(path: str, tp: int, args) -> dict:
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts = [
        {"prompt_token_ids": rng.integers(5, 400, args.prompt_len).tolist()} for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(
        path,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        device=args.device,
        max_model_len=args.prompt_len + args.output_len + 8,
        kv_cache_memory_bytes=args.kv_cache_mb << 20,
        max_num_seqs=args.num_prompts,
    )
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        executor.collective_rpc(install_probes)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        stats = executor.collective_rpc(read_probes)[0]  # rank 0
    finally:
        llm.llm_engine.shutdown()
    decode = [i for i, (n, _) in enumerate(stats["steps"]) if n <= args.num_prompts]
    prefill = [i for i in range(len(stats["steps"])) if i not in set(decode)]

    def summary(idx):
        if not idx:
            return None
        step = np.mean([stats["steps"][i][1] for i in idx])
        comm = [stats["comm"][i] for i in idx]
        return dict(
            steps=len(idx),
            step_ms=1e3 * step,
            calls=np.mean([len(c) for c in comm]),
            comm_bytes=np.mean([sum(b for _, b, _ in c) for c in comm]),
            comm_ms=1e3 * np.mean([sum(s for _, _, s in c) for c in comm]),
        )

    return dict(
        tp=tp,
        wall_s=wall,
        tok_s=args.num_prompts * args.output_len / wall,
        prefill=summary(prefill),
        decode=summary(decode),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-mb", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here, workers in processes
    from minivllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        args.arch,
        tempfile.mkdtemp(prefix="bench_dist_"),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
    )
    print(
        f"{args.arch}: hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads} heads "
        f"({args.num_kv_heads} KV), {args.dtype} on {args.device}; {args.num_prompts} prompts x "
        f"{args.prompt_len} tokens, {args.output_len} out; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    results = [run(path, tp, args) for tp in args.tp]
    base = results[0]["decode"]["step_ms"]
    print(
        f"\n{'TP':>3} {'phase':>8} {'steps':>6} {'step ms':>9} {'vs TP=1':>8} {'coll/step':>10} "
        f"{'KiB/step':>9} {'comm ms':>8} {'comm %':>7} {'tok/s':>8}"
    )
    for r in results:
        for phase in ("prefill", "decode"):
            s = r[phase]
            if s is None:
                continue
            ratio = f"{s['step_ms'] / base:.2f}x" if phase == "decode" else ""
            tok_s = f"{r['tok_s']:.1f}"
            share = 100 * s["comm_ms"] / s["step_ms"]
            print(
                f"{r['tp']:>3} {phase:>8} {s['steps']:>6} {s['step_ms']:>9.2f} {ratio:>8} "
                f"{s['calls']:>10.1f} {s['comm_bytes'] / 1024:>9.1f} {s['comm_ms']:>8.2f} {share:>6.1f}% "
                f"{tok_s if phase == 'decode' else '':>8}"
            )


if __name__ == "__main__":
    main()
