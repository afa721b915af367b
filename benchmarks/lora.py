"""Multi-LoRA throughput (issue 32): the same 32 prompts on the base model alone, then spread over 1, 4 and 8
LoRA adapters in the same batches, one run each. Prints the CPU flags, output tokens/s per configuration,
and the ratio of each configuration's time per step to the base model's (the issue's goal: 4 adapters in
one batch cost at most 1.3x the base model's step).

Workload (fixed seed): the embedded SmolLM2-135M-Instruct (or --model), prompts of random token ids with
lengths uniform in [min_len, max_len], --output-len tokens each (EOS ignored), greedy, no detokenization.
Adapters are random PEFT-format folders (`make_random_lora_adapter`, rank --rank on all seven projections)
written to a temporary directory and removed afterwards. Every LoRA configuration runs with max_loras =
its adapter count (all of them fit in one step) and --max-lora-rank = --rank. Engine start-up is not timed.

    python benchmarks/lora.py                       # 32 prompts, adapters 1/4/8, rank 8, float32
    python benchmarks/lora.py --dtype bfloat16 --kernel torch   # the index_select/bmm reference kernel
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_flags() -> str:
    "The avx* / amx* flags of this CPU (as `grep -o 'avx[^ ]*\\|amx[^ ]*' /proc/cpuinfo | sort -u`)."
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "(no /proc/cpuinfo)"
    return " ".join(sorted(set(re.findall(r"\b(?:avx|amx)\S*", text))))


def run(
    model: str, prompts: list[list[int]], args: argparse.Namespace, loras: list | None
) -> tuple[float, int, int]:
    "(seconds, output tokens, engine steps) of one `LLM.generate` over `prompts` (adapter i % len(loras))."
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams

    lora_args = (
        dict(enable_lora=True, max_loras=len(loras), max_cpu_loras=len(loras), max_lora_rank=args.rank)
        if loras
        else {}
    )
    llm = LLM(
        model,
        dtype=args.dtype,
        max_model_len=args.max_len + args.output_len + 8,
        max_num_seqs=len(prompts),
        seed=0,
        enable_prefix_caching=False,  # every run and configuration computes every prompt token
        **lora_args,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    requests = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    # warm-up: one prompt per adapter, so every adapter is loaded and in a slot before the timed run
    n_warm = max(2, len(loras or ()))
    warm = [{"prompt_token_ids": prompts[i % len(prompts)][:8]} for i in range(n_warm)]
    llm.generate(
        warm,
        sp,
        use_tqdm=False,
        lora_request=[loras[i % len(loras)] for i in range(n_warm)] if loras else None,
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    steps = [0]
    execute_model = runner.execute_model

    def counted(*a, **kw):
        steps[0] += 1
        return execute_model(*a, **kw)

    runner.execute_model = counted
    best = None
    for _ in range(args.repeat):  # the fastest of --repeat runs (1: the one run)
        steps[0] = 0
        start = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=requests
        )
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best[0]:
            best = (elapsed, sum(len(o.outputs[0].token_ids) for o in outs), steps[0])
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1, help="timed runs per configuration; the fastest counts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel", choices=("cpu", "torch"), default="cpu", help="MINIVLLM_LORA_KERNEL")
    args = p.parse_args()
    os.environ["MINIVLLM_LORA_KERNEL"] = args.kernel
    os.environ.setdefault(
        "MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0"
    )  # the engine in this process: steps counted

    import torch
    import transformers

    from minivllm.lora.models import make_random_lora_adapter
    from minivllm.lora.request import LoRARequest
    from minivllm.transformers_utils.embedded import resolve_model

    model = args.model or str(resolve_model(None))
    cfg = transformers.AutoConfig.from_pretrained(model)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, cfg.vocab_size) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_prompts)
    ]
    print(f"CPU flags: {cpu_flags()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {os.path.basename(model)}, "
        f"{args.dtype}, kernel {args.kernel}"
    )
    print(
        f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
        f"{args.output_len} output tokens each, rank {args.rank}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = [
            make_random_lora_adapter(f"{tmp}/a{i}", cfg, rank=args.rank, seed=i, std=0.02)
            for i in range(max(args.adapters))
        ]
        rows = [("base model", *run(model, prompts, args, None))]
        for n in args.adapters:
            loras = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(n)]
            rows.append((f"{n} adapter{'s' if n > 1 else ''}", *run(model, prompts, args, loras)))
    base_step = rows[0][1] / max(rows[0][3], 1)
    print(f"{'configuration':<14} {'tok/s':>8} {'steps':>6} {'ms/step':>8} {'step vs base':>13}")
    for name, seconds, tokens, steps in rows:
        per_step = seconds / max(steps, 1)
        print(
            f"{name:<14} {tokens / seconds:8.1f} {steps:6d} {1000 * per_step:8.1f} "
            f"{per_step / base_step:12.2f}x"
        )


if __name__ == "__main__":
    main()
