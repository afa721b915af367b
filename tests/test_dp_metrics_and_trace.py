"""Data parallelism and the two per-engine outputs of the front end (break pass 15A, items 1 and 2).

1. With `--data-parallel-size 2` the `/metrics` gauges had only a `model_name` label, and `AsyncLLM` set them
   from each engine's `SchedulerStats` in turn: the value was whichever engine reported last (4 prefills held
   per engine, engine A's released: `kv_cache_usage_perc` still read engine B's 40 blocks, and the reverse).
   Now every metric fed from `SchedulerStats` is labelled `engine="i"` too (vLLM v0.15): one series per
   engine.
2. `--trace-steps FILE` with two engines: both engine cores opened FILE; one engine's header and steps were
   lost and 2 of 11181 lines were corrupt JSON. Now engine r > 0 writes FILE with `.dp<r>` before the suffix.

One DP=2 `AsyncLLM` over a tiny checkpoint serves both tests: request A (long) on engine 0, and while A is
still decoding, request B (one token) on engine 1.
"""

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm.engine.arg_utils import EngineArgs
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM
from minivllm.v1.metrics.loggers import PrometheusStatLogger

A_PROMPT = [5 + j % 90 for j in range(21)]  # 21 tokens, engine 0
B_PROMPT = [7 + j % 80 for j in range(9)]  # 9 tokens, engine 1


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """Run A and B through a DP=2 AsyncLLM with a PrometheusStatLogger and `trace_steps`; returns the metrics
    snapshot taken after B finished while A was still running, and the trace path."""
    tmp = tmp_path_factory.mktemp("dp_metrics")
    path = make_tiny_checkpoint("llama", str(tmp / "llama"))
    trace = tmp / "trace.jsonl"
    prom = PrometheusStatLogger("tiny")  # as a server builds it, less `engine_indexes` (made lazily here)
    args = EngineArgs(
        model=path,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=1 << 20,
        data_parallel_size=2,
        trace_steps=str(trace),
    )
    llm = AsyncLLM.from_engine_args(args, stat_loggers=[prom], enable_multiprocessing=True)
    client = llm.engine_core
    procs = [c.proc for c in client.clients]
    got = {}

    async def only(prompt, params, rid):
        async for _ in llm.generate({"prompt_token_ids": prompt}, params, rid):
            pass

    async def main():
        long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
        n = 0
        async for _ in llm.generate({"prompt_token_ids": A_PROMPT}, long, "reqA"):
            n += 1
            if n == 3:  # A runs on engine 0: B goes to engine 1 (fewest in flight) and finishes
                await only(B_PROMPT, SamplingParams(temperature=0, max_tokens=1), "reqB")
                got["text"] = prom.generate().decode()
                got["a_in_flight"] = client.num_in_flight[0]
                got["per_engine"] = list(client.requests_per_engine)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        llm.shutdown()
        loop.close()
        for p in procs:
            p.join(10)
    assert not any(p.is_alive() for p in procs)
    return got, trace


def _samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_each_dp_engine_has_its_own_metric_series(dp_run):
    """Before: one `{model_name="tiny"}` series per gauge, set by whichever engine reported last (here
    engine 0, still decoding A, overwrote engine 1's idle figures), and no way to tell the engines apart.
    Now: series `engine="0"` (A running, its blocks in use) and `engine="1"` (B done: 0 running, 0 usage),
    and each engine's prefix-cache queries are its own prompt's tokens (21 and 9)."""
    got, _ = dp_run
    assert got["per_engine"] == [1, 1] and got["a_in_flight"] == 1  # A had not finished when read
    s = _samples(got["text"])
    e0 = (("engine", "0"), ("model_name", "tiny"))
    e1 = (("engine", "1"), ("model_name", "tiny"))
    assert (s[("vllm:num_requests_running", e0)], s[("vllm:num_requests_running", e1)]) == (1, 0)
    assert s[("vllm:kv_cache_usage_perc", e0)] > 0 and s[("vllm:kv_cache_usage_perc", e1)] == 0
    assert s[("vllm:num_requests_waiting", e0)] == s[("vllm:num_requests_waiting", e1)] == 0
    queries = (s[("vllm:prefix_cache_queries_total", e0)], s[("vllm:prefix_cache_queries_total", e1)])
    assert queries == (len(A_PROMPT), len(B_PROMPT))
    assert ("vllm:kv_cache_usage_perc", (("model_name", "tiny"),)) not in s  # no engine-less series
    assert (
        s[("vllm:generation_tokens_total", (("model_name", "tiny"),))] >= 3
    )  # front-end counters: model only


def test_each_dp_engine_writes_its_own_step_trace(dp_run):
    """Before: both engine cores wrote `trace.jsonl` (one header survived, lines interleaved, one engine's
    steps lost) and no `trace.dp1.jsonl` existed. Now: `trace.jsonl` is engine 0's (only A's steps) and
    `trace.dp1.jsonl` engine 1's (only B's), each valid JSON lines with one header of its own pid."""
    _, trace = dp_run
    files = [trace, trace.with_name("trace.dp1.jsonl")]
    assert all(f.exists() for f in files), sorted(p.name for p in trace.parent.iterdir())
    pids, ids = [], []
    for f in files:
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        assert lines[0]["kind"] == "header" and all(d.get("kind") != "header" for d in lines[1:])
        pids.append(lines[0]["pid"])
        steps = lines[1:]
        assert [d["step"] for d in steps] == list(range(len(steps)))
        ids.append({entry[0] for d in steps for entry in d["scheduled"]})
    assert pids[0] != pids[1]
    assert ids[0] and all(r.startswith("reqA") for r in ids[0])
    assert ids[1] and all(r.startswith("reqB") for r in ids[1])
