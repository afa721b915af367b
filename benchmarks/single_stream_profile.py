"""Where one sequence's decode step goes (issue 31 item 4): the engine's phases from the step trace, the
forward's parts from timers around each layer, and the share of the memory-bandwidth limit reached.

    python benchmarks/single_stream_profile.py [--dtype float32] [--tokens 128] [--prompt-len 40]
                                               [--prompts 1]

Three runs of the embedded SmolLM2 (or --model), engine core in this process, one prompt, greedy, EOS ignored:

1. default settings (CPU graphs on) with the step trace (chapter 24c): median milliseconds per decode step of
   `schedule()`, `execute_model` (the forward), `sample_tokens`, `update_from_output()` and the time between
   steps (the front end's output processing), and tok/s;
2. the same with graphs off (`MINIVLLM_CUDAGRAPH_MODE=NONE`) and a `time.perf_counter` pair around every
   linear (the GEMMs, split into the decoder's and the LM head's), attention layer, RMSNorm, rotary embedding
   and SiLU-and-mul call of the decode forward, summed per step; "rest" is the forward's time outside them
   (embedding, residual adds, Python between the layers). The timers cost a few microseconds per call, so the
   parts add up to slightly more than an untimed eager step;
3. the bandwidth limit: the machine's read bandwidth (`compare_engines.memory_read_gbs`) over the bytes of
   weights one step reads (`compare_engines.weight_bytes_per_token`), and the share run 1 reaches.

`--prompts N` runs N distinct prompts at once instead (the same split for a batch of N sequences per step).
Prints the CPU's model and flags and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compare_engines import cpu_info, memory_read_gbs, weight_bytes_per_token  # noqa: E402

PARTS = ("linear", "lm_head", "attention", "rmsnorm", "rope", "silu_and_mul")


def part_of(module) -> str | None:
    "The part a module's calls are counted in, by its class (None: not timed on its own)."
    names = {c.__name__ for c in type(module).__mro__}
    if "Attention" in names and type(module).__name__ == "Attention":
        return "attention"
    if "RMSNorm" in names:
        return "rmsnorm"
    if "RotaryEmbedding" in names:
        return "rope"
    if "SiluAndMul" in names:
        return "silu_and_mul"
    if "LinearBase" in names:
        return "linear"
    return None


def make_llm(model, dtype, trace=None):
    from minivllm import LLM

    kwargs = {"trace_steps": trace} if trace else {}
    return LLM(model, dtype=dtype, **kwargs)


def run(llm, prompt, tokens):
    from minivllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    return tokens * len(prompt) / (time.perf_counter() - t)


def phases(args, prompt) -> None:
    from minivllm.v1.engine.step_trace import load_step_trace

    trace = os.path.join(tempfile.mkdtemp(prefix="minivllm-profile-"), "steps.jsonl")
    llm = make_llm(args.model, args.dtype, trace)
    run(llm, prompt, 8)  # warm-up (graph capture of size 1, first-call costs)
    rates = [run(llm, prompt, args.tokens) for _ in range(3)]
    llm.llm_engine.engine_core.shutdown()
    n = len(prompt)
    steps = [s for s in load_step_trace(trace) if s.num_decode_tokens == n and s.num_prefill_tokens == 0]
    names = ["schedule_s", "execute_model_s", "sample_tokens_s", "update_s", "between_s"]
    med = {n: statistics.median(getattr(s, n) for s in steps) * 1e3 for n in names}
    total = sum(med.values())
    print(f"\n1. graphs on: {statistics.median(rates):.1f} tok/s (median of 3), {len(steps)} decode steps")
    for n in names:
        print(f"   {n[:-2]:<16} {med[n]:7.3f} ms  {med[n] / total:6.1%}")
    print(f"   {'sum':<16} {total:7.3f} ms")
    return statistics.median(rates)


def parts(args, prompt) -> None:
    os.environ["MINIVLLM_CUDAGRAPH_MODE"] = "NONE"
    llm = make_llm(args.model, args.dtype)
    del os.environ["MINIVLLM_CUDAGRAPH_MODE"]
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    model = runner.model
    spent = collections.Counter()
    calls = collections.Counter()

    def timed(fn, part):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[part] += time.perf_counter() - t
            calls[part] += 1
            return out

        return wrapper

    for _, m in model.named_modules():
        part = part_of(m)
        if part is not None:
            m.forward = timed(m.forward, part)
    model.compute_logits = timed(model.compute_logits, "lm_head")
    forward = timed(model.forward, "forward")
    model.forward = forward
    run(llm, prompt, 8)
    best = None
    for _ in range(3):
        spent.clear()
        calls.clear()
        rate = run(llm, prompt, args.tokens)
        if best is None or rate > best[0]:
            best = (rate, dict(spent), dict(calls))
    llm.llm_engine.engine_core.shutdown()
    rate, spent_, calls_ = best
    n = calls_["lm_head"]  # one per step (the prefills' included)
    step = (spent_["forward"] + spent_["lm_head"]) / n * 1e3
    print(f"\n2. graphs off, timed: {rate:.1f} tok/s (best of 3); forward + logits {step:.3f} ms per step")
    inside = 0.0
    for p in PARTS:
        ms = spent_.get(p, 0.0) / n * 1e3
        inside += ms
        print(f"   {p:<16} {ms:7.3f} ms  {ms / step:6.1%}  ({calls_.get(p, 0) / n:.0f} calls per step)")
    print(f"   {'rest':<16} {step - inside:7.3f} ms  {(step - inside) / step:6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=1)
    args = ap.parse_args()
    os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.model is None:
        from minivllm.transformers_utils.embedded import resolve_model

        args.model = str(resolve_model(None))
    model_name, flags = cpu_info()
    threads = len(os.sched_getaffinity(0))
    print(f"CPU: {model_name}; flags: {flags}; {threads} threads; load {os.getloadavg()[0]:.2f}")
    print(
        f"{args.model} {args.dtype}, {args.prompts} x {args.prompt_len}-token prompts, "
        f"{args.tokens} new tokens each"
    )
    prompt = [
        {"prompt_token_ids": list(range(1000 + i, 1000 + i + args.prompt_len))} for i in range(args.prompts)
    ]
    rate = phases(args, prompt)
    parts(args, prompt)
    gbs = memory_read_gbs(threads)
    limit = gbs * 1e9 / weight_bytes_per_token(args.model, args.dtype)
    print(
        f"\n3. read bandwidth {gbs:.1f} GB/s: the bandwidth limit is {limit:.1f} tok/s; graphs on reached "
        f"{rate / limit:.0%} of it (load {os.getloadavg()[0]:.2f}; meaningful for one prompt only)"
    )


if __name__ == "__main__":
    main()
