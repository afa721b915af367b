"""Step tracing's cost, and the simulator's speed (issue 21).

1. Tracer on vs off on benchmarks/throughput.py's workload (random token-id prompts, EOS ignored, greedy, no
   detokenization): two engines built once (engine core in this process), one with `trace_steps` set, then
   `--repeats` generate calls each, alternating off/on so that a change in the machine's load hits both alike.
   Prints output tokens/s per repetition, the medians, and the overhead (goal: under 2%). On a shared machine
   the medians move with the load by more than 2%, so the tracer's own work is also timed exactly: the seconds
   spent in `StepTraceRecorder.begin` / `finish` (wrapped here, in this process), as a share of the traced runs.
2. The SimulatedExecutor replaying a `--sim-requests` Poisson workload (default 10,000) on the same model's
   config: simulated requests per second of wall time.

    python benchmarks/trace_overhead.py                       # embedded SmolLM2, both parts
    python benchmarks/trace_overhead.py --num-prompts 16 --repeats 2 --sim-requests 0   # tracer only, quicker
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throughput import make_workload  # noqa: E402


def tracer_overhead(model: str, args) -> None:
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams
    from minivllm.v1.engine.step_trace import load_step_trace
    from transformers import AutoConfig

    from minivllm.v1.engine import step_trace

    spent = {"s": 0.0, "calls": 0}
    for name in ("begin", "finish"):  # time the recorder's own work (benchmark-only wrappers)
        orig = getattr(step_trace.StepTraceRecorder, name)

        def timed(*a, _orig=orig, **kw):
            t = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                spent["s"] += time.perf_counter() - t
                spent["calls"] += 1

        setattr(step_trace.StepTraceRecorder, name, timed)
    os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, out_lens = make_workload(vocab, args.num_prompts, args.min_len, args.max_len, args.output_len,
                                      args.output_len, args.seed)
    trace = os.path.join(tempfile.mkdtemp(prefix="minivllm-trace-"), "trace.jsonl")
    common = dict(model=model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_len + args.output_len)
    if args.build_traced_first:  # the engine built second may run slower or faster on its own: swap to see
        engines = {"on": LLM(**common, trace_steps=trace), "off": LLM(**common)}
    else:
        engines = {"off": LLM(**common), "on": LLM(**common, trace_steps=None if args.control else trace)}
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens]
    for llm in engines.values():  # warm-up
        llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    print(f"model={model} prompts={len(prompts)} input_len=[{args.min_len},{args.max_len}] output_len={args.output_len} "
          f"dtype={args.dtype}")
    tps, on_wall = {"off": [], "on": []}, 0.0
    spent["s"], spent["calls"] = 0.0, 0
    for rep in range(args.repeats):
        for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            t = time.perf_counter()
            outs = engines[name].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n == sum(out_lens)
            tps[name].append(n / dt)
            on_wall += dt if name == "on" else 0.0
            print(f"  repeat {rep} tracer {name:>3}: {n / dt:8.1f} output tok/s ({dt:.1f} s)", flush=True)
    off, on = statistics.median(tps["off"]), statistics.median(tps["on"])
    if args.control:
        print(f"control (neither engine traced): first {off:.1f} tok/s, second {on:.1f} tok/s, {(off - on) / off:+.2%}")
        return
    steps = load_step_trace(trace)
    print(f"median: tracer off {off:.1f} tok/s, on {on:.1f} tok/s, overhead {(off - on) / off:+.2%} "
          f"({len(steps)} steps traced, {os.path.getsize(trace) / 1e6:.1f} MB)")
    print(f"recorder's own work: {spent['s'] * 1e3:.1f} ms over {spent['calls'] // 2} steps "
          f"({spent['s'] / max(1, spent['calls'] // 2) * 1e6:.0f} us/step), {spent['s'] / on_wall:.3%} of the traced runs")
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()


def simulator_speed(model: str, args) -> None:
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.v1.executor.simulated_executor import CostModel, poisson_workload, simulate

    wl = poisson_workload(args.sim_requests, rate=args.sim_rate, prompt_len=lambda r: r.randint(32, 1024),
                          output_len=lambda r: r.randint(16, 128), seed=args.seed)
    cost = CostModel(a=0.005, b=0.0001, c=0.0005, d=1e-7)
    res = simulate(wl, EngineArgs(model=model, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                                  kv_cache_memory_bytes=2**30), cost)
    print(f"simulator: {len(wl)} requests, {res.num_steps} steps, {res.total_s:.0f} virtual s in {res.wall_s:.1f} s "
          f"of wall time: {res.requests_per_wall_s:.0f} simulated requests/s, {res.num_steps / res.wall_s:.0f} steps/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="generate calls per engine, alternating off/on")
    ap.add_argument("--sim-requests", type=int, default=10_000, help="0 skips the simulator part")
    ap.add_argument("--sim-rate", type=float, default=20.0, help="Poisson arrivals per virtual second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control", action="store_true", help="A/A run: the 'on' engine is not traced either")
    ap.add_argument("--build-traced-first", action="store_true", help="build the traced engine first")
    args = ap.parse_args()
    from minivllm.transformers_utils.embedded import resolve_model

    model = str(resolve_model(args.model))
    if args.repeats > 0:
        tracer_overhead(model, args)
    if args.sim_requests > 0:
        simulator_speed(model, args)


if __name__ == "__main__":
    main()
