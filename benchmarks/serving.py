"""Online serving benchmark, like vLLM's `benchmarks/benchmark_serving.py`, against minivllm's OpenAI server.

Streams every request (SSE) and measures, per request, the time to first token (TTFT), the time per
output token after the first (TPOT), the gaps between chunks (ITL) and the end-to-end latency; prints
request / token throughput and p50/p90/p99 of each. Two load shapes:

* open loop (vLLM's): `--num-prompts N` requests arriving as a Poisson process at `--request-rate` per
  second (default `inf`: all at once), optionally capped at `--max-concurrency` in flight;
* closed loop: `--duration S --max-concurrency C`: C clients, each sending its next request as soon as
  the previous one ends, for S seconds (the "64 clients for 60 s" load run).

The server is either running already (`--base-url`) or launched in a subprocess (`--launch`: the
embedded model, `--model DIR`, or `--tiny` for a random tiny llama checkpoint), so client and engine
do not share a Python interpreter. The client is a minimal asyncio HTTP/1.1 SSE reader, so its own
cost stays small next to the engine's. `--check-offline` re-runs each distinct prompt greedily with
the offline `LLM` and reports how many served outputs equal the offline ones (needs temperature 0).

    python benchmarks/serving.py --launch --tiny --num-prompts 64 --max-tokens 32
    python benchmarks/serving.py --launch --num-prompts 100 --request-rate 4 --max-tokens 64
    python benchmarks/serving.py --launch --duration 60 --max-concurrency 64 --max-tokens 64 --check-offline
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model-name tiny --num-prompts 200
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one paragraph.", "Write a haiku about the sea.",
    "List three uses of a paperclip.", "Why is the sky blue?", "Give me a short recipe for pancakes.",
    "What does a CPU do?", "Summarize the plot of Cinderella.", "How do vaccines work?", "Name five fruits.",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "How many legs does a spider have?", "What is machine learning?", "Describe a rainbow to a child.",
    "Translate 'good morning' into Spanish.", "What causes tides?", "Write a two-line poem about coffee.",
    "Why do cats purr?", "What is the boiling point of water?", "Suggest a name for a pet turtle.",
    "What is gravity?", "How do airplanes fly?", "Give three tips for better sleep.",
]


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_idx: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""


async def stream_request(host: str, port: int, path: str, body: dict, api_key: str | None, idx: int) -> RequestResult:
    """POST `body`, read the SSE stream to `[DONE]`, time each chunk. A stream that ends without `[DONE]` (the
    server died or cut the connection mid-answer) is a failure, like an error chunk or a non-200 status."""
    res = RequestResult(prompt_idx=idx)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\nConnection: close\r\n")
    if api_key: head += f"Authorization: Bearer {api_key}\r\n"
    start = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head.encode() + b"\r\n" + payload)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower(): chunked = True
        if status != 200:
            res.error = f"HTTP {status}: {(await reader.read())[:300]!r}"
            return res
        last, parts, buf, done = start, [], b"", False
        async def lines():
            nonlocal buf
            while True:
                if chunked:
                    size = int((await reader.readline()).strip() or b"0", 16)
                    if size == 0: return
                    data = await reader.readexactly(size + 2)
                    buf += data[:-2]
                else:
                    data = await reader.read(65536)
                    if not data: return
                    buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    yield line
        async for line in lines():
            if not line.startswith(b"data: "): continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk: res.error = chunk["error"]["message"]; return res
            if chunk.get("usage"):
                res.output_tokens, res.prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
            if not chunk.get("choices"): continue
            ch = chunk["choices"][0]
            piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            if not piece: continue
            now = time.perf_counter()
            if not parts: res.ttft = now - start
            else: res.itl.append(now - last)
            last = now
            parts.append(piece)
        res.latency = time.perf_counter() - start
        res.text = "".join(parts)
        if not done:
            res.error = f"the stream ended without [DONE] after {len(parts)} chunks"
            return res
        res.ok = True
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return res


def make_body(args, prompt: str) -> dict:
    body = {"model": args.model_name, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "/v1/chat/completions": body["messages"] = [{"role": "user", "content": prompt}]
    else: body["prompt"] = prompt
    return body


async def run_open_loop(args, host, port, prompts) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async def one(i):
        if sem is None: return await stream_request(host, port, args.endpoint, make_body(args, prompts[i % len(prompts)]), args.api_key, i % len(prompts))
        async with sem: return await stream_request(host, port, args.endpoint, make_body(args, prompts[i % len(prompts)]), args.api_key, i % len(prompts))
    tasks = []
    start = time.perf_counter()
    for i in range(args.num_prompts):
        tasks.append(asyncio.create_task(one(i)))
        if args.request_rate != math.inf: await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def run_closed_loop(args, host, port, prompts) -> tuple[list[RequestResult], float]:
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + args.duration
    async def client(c):
        k = c
        while time.perf_counter() < deadline:
            idx = k % len(prompts)
            results.append(await stream_request(host, port, args.endpoint, make_body(args, prompts[idx]), args.api_key, idx))
            k += args.max_concurrency
    await asyncio.gather(*(client(c) for c in range(args.max_concurrency)))
    return results, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    if not xs: return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.output_tokens]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.latency for r in ok]
    s = {"successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput_req_s": len(ok) / duration, "output_throughput_tok_s": out_tokens / duration,
         "total_token_throughput_tok_s": (in_tokens + out_tokens) / duration}
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        s[f"mean_{name}"] = 1000 * sum(xs) / len(xs) if xs else float("nan")
        for q in (50, 90, 99): s[f"p{q}_{name}"] = 1000 * pct(xs, q)
    return s


def print_summary(s: dict, errors: list[str]) -> None:
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for k in ("successful_requests", "failed_requests", "duration_s", "total_input_tokens", "total_output_tokens",
              "request_throughput_req_s", "output_throughput_tok_s", "total_token_throughput_tok_s"):
        v = s[k]
        print(f"{k:<40}{v:>12.2f}" if isinstance(v, float) else f"{k:<40}{v:>12}")
    for name, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                        ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        print("-" * 15 + f" {title} " + "-" * 15)
        for k in ("mean", "p50", "p90", "p99"): print(f"{k + ' (ms)':<40}{s[f'{k}_{name}']:>12.2f}")
    print("=" * 66)
    for e in errors[:5]: print("error:", e)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def launch_server(args) -> tuple[subprocess.Popen, str]:
    "Start `minivllm serve` in a subprocess on a free port; wait for /health."
    model = args.model
    if args.tiny:
        from minivllm.testing import make_tiny_checkpoint
        model = args.model = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="tiny-llama-"))
    port = free_port()
    argv = ["serve"] + ([model] if model else []) + ["--host", "127.0.0.1", "--port", str(port), "--served-model-name",
            args.model_name, "--uvicorn-log-level", "warning", "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len: argv += ["--max-model-len", str(args.max_model_len)]
    if args.dtype: argv += ["--dtype", args.dtype]
    if args.api_key: argv += ["--api-key", args.api_key]
    code = "import sys; from minivllm.entrypoints.cli.main import main; sys.exit(main())"   # = `minivllm serve ...`
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None: raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2); return proc, url
        except Exception:
            if time.monotonic() > deadline: proc.kill(); raise RuntimeError("server did not become healthy")
            time.sleep(0.5)


def check_offline(args, prompts, results) -> None:
    "Compare each served greedy output with the offline LLM's output for the same prompt."
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams
    used = sorted({r.prompt_idx for r in results if r.ok})
    kw = {"model": args.model} if args.model else {}
    if args.dtype: kw["dtype"] = args.dtype
    if args.max_model_len: kw["max_model_len"] = args.max_model_len
    llm = LLM(**kw, max_num_seqs=args.max_num_seqs)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    if args.endpoint == "/v1/chat/completions":
        outs = llm.chat([[{"role": "user", "content": prompts[i]}] for i in used], sp, use_tqdm=False)
    else:
        outs = llm.generate([prompts[i] for i in used], sp, use_tqdm=False)
    offline = {i: o.outputs[0].text for i, o in zip(used, outs)}
    ok = [r for r in results if r.ok]
    same = sum(r.text == offline[r.prompt_idx] for r in ok)
    print(f"offline check: {same}/{len(ok)} served outputs equal the offline LLM's greedy outputs")
    shared = sorted(len(os.path.commonprefix([r.text, offline[r.prompt_idx]])) for r in ok if r.text != offline[r.prompt_idx])
    if shared:
        # greedy decoding is exact per batch, but a different batch mix changes float rounding; near-ties can then flip
        print(f"  mismatches share a prefix of {shared[0]}..{shared[-1]} characters (median {shared[len(shared) // 2]}) "
              "with the offline text before diverging")
        for r in ok:
            if r.text != offline[r.prompt_idx]:
                k = len(os.path.commonprefix([r.text, offline[r.prompt_idx]]))
                print(f"  e.g. prompt {r.prompt_idx}: ...{r.text[max(0, k - 30):k + 30]!r} vs ...{offline[r.prompt_idx][max(0, k - 30):k + 30]!r}")
                break

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="A running server (else use --launch).")
    ap.add_argument("--launch", action="store_true", help="Start `minivllm serve` in a subprocess.")
    ap.add_argument("--model", default=None, help="Checkpoint folder for --launch (default: the embedded model).")
    ap.add_argument("--tiny", action="store_true", help="With --launch: serve a random tiny llama checkpoint.")
    ap.add_argument("--model-name", default="bench", help="Served model name.")
    ap.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate (req/s); inf = all at once.")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--duration", type=float, default=None, help="Closed loop for this many seconds (needs --max-concurrency).")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--check-offline", action="store_true", help="Compare with the offline LLM (greedy only).")
    ap.add_argument("--result-json", default=None, help="Also write the summary here.")
    args = ap.parse_args()
    if args.duration is not None and not args.max_concurrency: ap.error("--duration needs --max-concurrency")
    if args.tiny and args.endpoint == "/v1/chat/completions": pass   # the tiny tokenizer has a ChatML template
    proc = None
    if args.launch: proc, url = launch_server(args)
    elif args.base_url: url = args.base_url
    else: ap.error("give --base-url or --launch")
    u = urlparse(url)
    prompts = QUESTIONS
    try:
        # one warm-up request, not measured
        warm = asyncio.run(stream_request(u.hostname, u.port, args.endpoint, make_body(args, "Hello"), args.api_key, 0))
        if not warm.ok: raise RuntimeError(f"warm-up failed: {warm.error}")
        runner = run_closed_loop if args.duration is not None else run_open_loop
        results, duration = asyncio.run(runner(args, u.hostname, u.port, prompts))
    finally:
        if proc is not None:
            proc.terminate()
            try: proc.wait(30)
            except subprocess.TimeoutExpired: proc.kill()
    s = summarize(results, duration)
    mode = (f"closed loop, {args.max_concurrency} clients, {args.duration:.0f} s" if args.duration is not None else
            f"{args.num_prompts} prompts, rate {args.request_rate}, max concurrency {args.max_concurrency}")
    print(f"{url}{args.endpoint} | {mode} | max_tokens {args.max_tokens}")
    print_summary(s, [r.error for r in results if not r.ok])
    if args.result_json: json.dump(s | {"mode": mode}, open(args.result_json, "w"), indent=1)
    if args.check_offline: check_offline(args, prompts, results)


if __name__ == "__main__":
    main()
