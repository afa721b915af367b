"""KV transfer, measured: time to first token (TTFT) and decode speed for one long prompt, with and without
ExampleConnector reuse, and through a P2pZmqConnector producer/consumer pair against one instance.

    python benchmarks/kv_transfer.py [--model PATH] [--prompt-tokens 2048] [--decode-tokens 64] [--dtype float32]

All engines run in this process, on the CPU; the embedded SmolLM2-135M-Instruct by default. TTFT is the
wall time of a `max_tokens=1` request (for the pair: the producer's prefill plus the consumer's pull and
first token). "bytes moved" is what the connector wrote or read for the request: every layer's K and V of
the prompt's full blocks. Decode tokens/s come from one request's first and last token times.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import tempfile
import time

from minivllm import LLM, SamplingParams


def _cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0]
    except (OSError, IndexError):
        return platform.processor()
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return " ".join(keep) or "no avx2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(llm: LLM, prompt: list[int], max_tokens: int, extra: dict | None = None):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out


def _decode_rate(out) -> float:
    "Decode tokens/s of one request, from its first and last token times (engine-core clock)."
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    if m is None or m.first_token_time is None or m.last_token_time is None or n < 2:
        return float("nan")
    return (n - 1) / max(m.last_token_time - m.first_token_time, 1e-9)


def _warm(llm: LLM) -> LLM:
    "One short request first: kernels compiled and caches touched before anything is timed."
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2), use_tqdm=False)
    return llm


def _block_bytes(llm: LLM) -> int:
    cfg = llm.llm_engine.vllm_config
    mc, bs = cfg.model_config, cfg.cache_config.block_size
    return 2 * mc.get_num_layers() * bs * mc.get_num_kv_heads() * mc.get_head_size() * mc.dtype.itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = dict(dtype=args.dtype, max_model_len=args.prompt_tokens + args.decode_tokens + 16)
    prompt = [(7 * i + 11) % 20000 + 100 for i in range(args.prompt_tokens)]
    rows = []

    base = _warm(LLM(args.model, **kw))
    block_bytes, bs = _block_bytes(base), base.llm_engine.vllm_config.cache_config.block_size
    moved = (len(prompt) - 1) // bs * block_bytes
    ttft_base, _ = _run(base, prompt, 1)
    base.reset_prefix_cache()
    _, out = _run(base, prompt, args.decode_tokens)
    dec_base = _decode_rate(out)
    base.llm_engine.shutdown()
    rows.append(("one instance, no connector", ttft_base, dec_base, 0))

    folder = tempfile.mkdtemp(prefix="kvt-bench-")
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": folder}}
    cold = _warm(LLM(args.model, kv_transfer_config=kvt, **kw))
    ttft_cold, _ = _run(cold, prompt, 1)
    cold.llm_engine.shutdown()
    rows.append(("ExampleConnector, cold (saves)", ttft_cold, float("nan"), moved))
    warm = _warm(LLM(args.model, kv_transfer_config=kvt, **kw))
    ttft_warm, _ = _run(warm, prompt, 1)
    warm.llm_engine.shutdown()
    rows.append(("ExampleConnector, warm (fresh engine loads)", ttft_warm, float("nan"), moved))

    port = _free_port()
    prod = _warm(LLM(args.model, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer",
                                                     "kv_port": port}, **kw))
    cons = _warm(LLM(args.model, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"},
                     **kw))
    t_p, first = _run(prod, prompt, 1, {"kv_transfer_params": {"do_remote_decode": True}})
    prod.llm_engine.step()  # registers the blocks with the producer's server
    params = first.kv_transfer_params
    t_c1, _ = _run(cons, prompt, 1, {"kv_transfer_params": dict(params)})
    rows.append(("P/D pair: prefill + pull + first token", t_p + t_c1, float("nan"), moved))
    t_p2, first = _run(prod, prompt + [1], 1, {"kv_transfer_params": {"do_remote_decode": True}})
    prod.llm_engine.step()
    _, out = _run(cons, prompt + [1], args.decode_tokens, {"kv_transfer_params": dict(first.kv_transfer_params)})
    dec_pd = _decode_rate(out)
    rows.append(("P/D pair: consumer decode", float("nan"), dec_pd, moved))
    prod.llm_engine.shutdown()
    cons.llm_engine.shutdown()

    print(f"prompt {len(prompt)} tokens, decode {args.decode_tokens}, dtype {args.dtype}, "
          f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, CPU flags: {_cpu_flags()}")
    print(f"{'setting':46s} {'TTFT s':>8s} {'vs base':>8s} {'decode tok/s':>13s} {'MB moved':>9s}")
    for name, ttft, dec, nbytes in rows:
        ratio = ttft / ttft_base if ttft == ttft else float("nan")
        print(f"{name:46s} {ttft:8.3f} {ratio:7.2f}x {dec:13.1f} {nbytes / 2**20:9.1f}")


if __name__ == "__main__":
    main()
