"""Structured-output overhead: output tokens/s of the same batch with and without a JSON schema, in one run.

    python benchmarks/structured.py [--model PATH] [--num-prompts 16] [--max-tokens 96] [--dtype float32]

Greedy chat requests on the embedded SmolLM2-135M-Instruct by default (each asks for a small JSON record).
"free" runs them unconstrained; "json_schema" constrains each to a schema (xgrammar grammar, bitmask per
step); "regex" to a short pattern. Output tokens/s counts the tokens actually generated (constrained outputs
end when the grammar does). Prints CPU flags and the ratio to the free run.
"""
from __future__ import annotations

import argparse
import os
import time

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0]
    except (OSError, IndexError):
        return "?"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags) or "no avx2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024)
    convs = [[{"role": "user", "content": f"Invent person number {i} as JSON with name, age and tags."}]
             for i in range(args.num_prompts)]
    settings = [
        ("free", None),
        ("json_schema", StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        ("regex", StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{2}")),
    ]
    llm.chat(convs[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    rows = []
    for name, so in settings:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
        t = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append((name, tokens, dt, tokens / dt))
    llm.llm_engine.shutdown()
    base = rows[0][3]
    print(f"{args.num_prompts} prompts, max {args.max_tokens} tokens, dtype {args.dtype}, "
          f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, CPU flags: {_cpu_flags()}")
    print(f"{'setting':14s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s} {'vs free':>8s}")
    for name, tokens, dt, rate in rows:
        print(f"{name:14s} {tokens:7d} {dt:8.2f} {rate:8.1f} {rate / base:7.2f}x")


if __name__ == "__main__":
    main()
