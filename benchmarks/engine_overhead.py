"""Engine-core CPU overhead: schedule() + update_from_output() per step, with a stub model.

256 running requests decode one token per step (plus a trickle of new prompts), on a real KVCacheManager with
prefix caching; the "model" returns last-token + 1 instantly, so the time measured is the scheduler's alone.
Prints microseconds per step (median and p90) for schedule() and update_from_output() separately.

    python benchmarks/engine_overhead.py [--requests 256] [--steps 300]

    python benchmarks/engine_overhead.py --e2e [--model DIR] [--prompts 32] [--output-len 64]

`--e2e` instead runs the walking skeleton's workload (greedy, ignore_eos, the embedded SmolLM2 unless --model)
through `LLM.generate` three times: engine core in-process, engine core in its own process (ZMQ), and engine
core process + one worker process (`distributed_executor_backend="mp"`: shared-memory MessageQueues), and
prints output tokens/s of each and the ratios to in-process (the split should not be more than 5% slower).
`--tiny` uses a tiny random Llama instead, so the per-step overhead dominates.
"""
import argparse
import json
import statistics
import tempfile
import time

import torch

from minivllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.kv_cache_utils import get_hash_fn_by_name, get_request_block_hasher, init_none_hash
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.request import Request


def make_scheduler(num_requests: int, block_size: int = 16) -> Scheduler:
    d = tempfile.mkdtemp()
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096},
              open(f"{d}/config.json", "w"))
    vc = VllmConfig(ModelConfig(d, max_model_len=4096), cache_config=CacheConfig(block_size=block_size),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_requests + 64,
                                                     max_model_len=4096))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return Scheduler(vc, KVCacheConfig(num_requests * 64, [], [KVCacheGroupSpec(["layer.0"], spec)]), log_stats=True)


def stub_output(s: Scheduler, so) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.requests[rid]
        sampled.append([(r.all_token_ids[-1] + 1) % 32000] if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)


def e2e(args) -> None:
    import os
    import random
    from minivllm.entrypoints.llm import LLM
    rng = random.Random(0)
    results = {}
    if args.tiny:
        from minivllm.testing import make_tiny_checkpoint
        args.model = make_tiny_checkpoint("llama", tempfile.mkdtemp())
    modes = {"in-process": ("0", "uni"), "process split": ("1", "uni"), "+ worker proc": ("1", "mp")}
    for mode, (multiproc, backend) in modes.items():
        os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = multiproc
        llm = LLM(args.model, dtype=args.dtype, max_model_len=512 if args.tiny else 1024, distributed_executor_backend=backend)
        vocab = llm.llm_engine.model_config.get_vocab_size() if args.tiny else llm.get_tokenizer().vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(rng.randint(64, 256))]}
                   for _ in range(args.prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        dt = float("inf")
        for _ in range(args.repeats):   # best of N: the machine is shared
            llm.llm_engine.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = min(dt, time.perf_counter() - t0)
        results[mode] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
        print(f"{mode:14s}: {results[mode]:8.1f} output tokens/s  ({dt:.1f} s)")
        llm.llm_engine.shutdown()
        rng = random.Random(0)
    for mode in list(modes)[1:]:
        print(f"{mode} / in-process: {results[mode] / results['in-process']:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of --model")
    ap.add_argument("--repeats", type=int, default=3, help="--e2e: timed runs per mode (the best is reported)")
    args = ap.parse_args()
    if args.e2e: return e2e(args)
    hash_fn = get_hash_fn_by_name("sha256_cbor"); init_none_hash(hash_fn)
    hasher = get_request_block_hasher(16, hash_fn)
    s = make_scheduler(args.requests)
    counter = 0

    def add(n):
        nonlocal counter
        for _ in range(n):
            prompt = [(counter * 7 + j) % 32000 for j in range(128)]
            s.add_request(Request(f"r{counter}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True),
                                  eos_token_id=2, block_hasher=hasher))
            counter += 1

    add(args.requests)
    while s.waiting:  # prefill everything first, so the timed steps are steady-state decode
        so = s.schedule(); s.update_from_output(so, stub_output(s, so))
    t_sched, t_update = [], []
    for step in range(args.steps):
        t0 = time.perf_counter(); so = s.schedule(); t1 = time.perf_counter()
        out = stub_output(s, so)
        t2 = time.perf_counter(); s.update_from_output(so, out); t3 = time.perf_counter()
        t_sched.append((t1 - t0) * 1e6); t_update.append((t3 - t2) * 1e6)
    q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))]
    print(f"{len(s.running)} running requests, {args.steps} decode steps (stub model)")
    print(f"schedule():           median {statistics.median(t_sched):8.0f} us   p90 {q(t_sched, 0.9):8.0f} us")
    print(f"update_from_output(): median {statistics.median(t_update):8.0f} us   p90 {q(t_update, 0.9):8.0f} us")
    print(f"per request per step: {statistics.median([a + b for a, b in zip(t_sched, t_update)]) / len(s.running):.1f} us")


if __name__ == "__main__":
    main()
