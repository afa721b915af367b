"""Multimodal serving costs: requests/s and TTFT with one image per request, processor cache off vs on, and
the encoder-cache hit rate when half of the images repeat, side by side in one run.

    python benchmarks/multimodal.py [--model PATH] [--num-requests 32] [--image-size 640x480] [--max-tokens 8]
                                    [--repeat 3]

With no --model it builds the tiny random-weight Gemma 3 vision-language checkpoint of the tests (a 2-layer
SigLIP on 32x32 inputs, so the HF image processor's resize of a large photo is a real part of the cost).
Each configuration runs the same workload in a fresh engine (in-process, so that the encoder and processor
counters can be read): `unique` = every image different; `half repeat` = each image sent twice, shuffled.
Columns: requests/s (wall time of one `generate` over all requests), mean TTFT (submission to first token),
HF processor calls, vision-encoder batches and items, encoder-cache hit rate (1 - encoded / image requests).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402


def _cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0]
    except (OSError, IndexError):
        return "?"
    return (
        " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags) or "no avx2"
    )


def images(n: int, size: tuple[int, int], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def run(model: str, workload: list[Image.Image], cache_gb: float, max_tokens: int) -> dict:
    llm = LLM(model, dtype="float32", mm_processor_cache_gb=cache_gb, enable_prefix_caching=False)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.model_runner
    original = runner._execute_mm_encoder

    def counting(so):
        before = set(runner.encoder_cache)
        original(so)
        counting.items += len(set(runner.encoder_cache) - before)

    counting.items = 0
    runner._execute_mm_encoder = counting
    prompt = (
        "<bos><start_of_turn>user\n<start_of_image>Describe the image.<end_of_turn>\n<start_of_turn>model\n"
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    generate(
        [{"prompt": prompt, "multi_modal_data": {"image": [images(1, (64, 64), 99)[0]]}}], llm, params
    )  # warm-up
    runner.num_encoder_runs, counting.items = 0, 0
    processor = llm.llm_engine.input_processor.mm_processor
    processor.num_hf_calls = 0
    items = [{"prompt": prompt, "multi_modal_data": {"image": [img]}} for img in workload]
    t0, t0_mono = time.perf_counter(), time.monotonic()
    outs = generate(items, llm, params)
    wall = time.perf_counter() - t0
    # all requests are submitted at t0; first_token_time is the engine core's time.monotonic (same process)
    ttft = [o.metrics.first_token_time - t0_mono for o in outs if o.metrics and o.metrics.first_token_time]
    return {
        "req/s": len(items) / wall,
        "TTFT ms": 1000 * float(np.mean(ttft)) if ttft else float("nan"),
        "HF calls": processor.num_hf_calls,
        "enc batches": runner.num_encoder_runs,
        "enc items": counting.items,
        "enc hit rate": 1 - counting.items / len(items),
    }


def generate(items, llm, params):
    return llm.generate(items, params, use_tqdm=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration; the median run is shown")
    args = ap.parse_args()
    size = tuple(int(x) for x in args.image_size.split("x"))
    model = args.model
    if model is None:
        from minivllm.testing import make_tiny_checkpoint

        model = make_tiny_checkpoint("gemma3_mm", tempfile.mkdtemp())
    n = args.num_requests
    unique = images(n, size, seed=0)
    half = images(n // 2, size, seed=1) * 2
    random.Random(0).shuffle(half)
    print(
        f"CPU flags: {_cpu_flags()}; threads {os.environ.get('OMP_NUM_THREADS', 'default')}; "
        f"{n} requests, 1 image of {size[0]}x{size[1]} each, {args.max_tokens} tokens out"
    )
    rows = []
    for name, workload in (("unique", unique), ("half repeat", half)):
        for cache_gb in (0.0, 4.0):
            runs = sorted(
                (run(model, workload, cache_gb, args.max_tokens) for _ in range(args.repeat)),
                key=lambda r: r["req/s"],
            )
            rows.append((name, "off" if cache_gb == 0 else "on", runs[len(runs) // 2]))
    cols = list(rows[0][2])
    print(f"{'workload':<12} {'proc cache':<10} " + " ".join(f"{c:>12}" for c in cols))
    for name, cache, r in rows:
        cells = " ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols)
        print(f"{name:<12} {cache:<10} {cells}")
    base = {name: r["req/s"] for name, cache, r in rows if cache == "off"}
    for name, cache, r in rows:
        if cache == "on":
            print(f"{name}: processor cache on / off = {r['req/s'] / base[name]:.2f}x requests/s")


if __name__ == "__main__":
    main()
