"""LMCacheConnectorV1's two modes, measured: loads and saves before / after the forward (synchronous) or
layer by layer on background threads beside it (`use_layerwise`).

    python benchmarks/lmcache_layerwise.py [--model PATH] [--prompt-tokens 2048] [--repeats 5]
                                           [--tier cpu|disk]

One engine per mode, in this process, on the CPU (the embedded SmolLM2-135M-Instruct by default: 30 layers).
"cold" is the wall time of a `max_tokens=1` request whose prompt is new (its chunks are computed and saved);
"warm" repeats a stored prompt (its chunks are loaded, only the tail is computed). Medians and minima of
`--repeats` runs per mode, the modes alternating run by run so that a busy neighbour hurts both alike (on a
shared machine the minimum is the steadier figure). The local prefix
cache is off, so the warm request's prefix comes from the connector. Prints the CPU flags and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from minivllm import LLM, SamplingParams


def _cpu_flags() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    flags = set(text.split("flags")[1].split("\n")[0].split())
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return " ".join(keep) or "no avx2"


def _engine(model: str | None, layerwise: bool, tier: str, folder: str) -> LLM:
    extra = {"chunk_size": 256, "use_layerwise": layerwise}
    if tier == "disk":
        extra.update(local_cpu=False, local_disk=os.path.join(folder, "lw" if layerwise else "sync"))
        extra["max_local_disk_size"] = 2.0
    else:
        extra.update(local_cpu=True, max_local_cpu_size=2.0)
    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    kw = {"model": model} if model else {}
    return LLM(**kw, enable_prefix_caching=False, kv_transfer_config=kvt)


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t, list(out.outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tier", choices=["cpu", "disk"], default="cpu")
    args = ap.parse_args()
    print(f"CPU flags: {_cpu_flags()}; threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-") as folder:
        engines = {mode: _engine(args.model, mode, args.tier, folder) for mode in (False, True)}
        try:
            times = {(mode, kind): [] for mode in engines for kind in ("cold", "warm")}
            tokens = {}
            for r in range(args.repeats + 1):  # run 0 warms kernels and caches; not counted
                prompt = [(7 * r + 11 * i) % 400 + 5 for i in range(args.prompt_tokens)]
                for mode, llm in engines.items():
                    cold, first = _ttft(llm, prompt)
                    warm, again = _ttft(llm, prompt)
                    tokens.setdefault(r, first)
                    if first != tokens[r] or again != first:
                        raise SystemExit(f"mode use_layerwise={mode} gave other tokens: {first} {again}")
                    if r:
                        times[(mode, "cold")].append(cold)
                        times[(mode, "warm")].append(warm)
        finally:
            for llm in engines.values():
                llm.llm_engine.shutdown()
    print(f"{args.prompt_tokens}-token prompt, {args.tier} tier, {args.repeats} runs (ms, median / fastest):")
    print(f"{'':>12} {'cold':>17} {'warm':>17}")
    for mode in engines:
        name = "layerwise" if mode else "synchronous"
        row = [f(times[(mode, kind)]) * 1e3 for kind in ("cold", "warm") for f in (statistics.median, min)]
        print(f"{name:>12} {row[0]:8.1f} {row[1]:8.1f} {row[2]:8.1f} {row[3]:8.1f}")
    for kind in ("cold", "warm"):
        for label, f in (("median", statistics.median), ("fastest", min)):
            ratio = f(times[(True, kind)]) / f(times[(False, kind)])
            print(f"layerwise / synchronous, {kind}, {label}: {ratio:.3f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
