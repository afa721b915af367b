"""Limits of the engine side, from issue 12: one request with thousands of samples completes through the
process split (the ZMQ sockets queue every message instead of dropping some and hanging); integers and floats
outside what msgpack or the sampler can carry are ValueErrors naming the field; engine settings that cannot
work (`block_size=7`, `seed="abc"`) are refused up front; EOS as the last allowed token finishes with "stop";
and the serving benchmark counts a stream without `[DONE]` as a failure. Tiny random-weight checkpoints, a few
tokens per request."""
import math
import os
import subprocess
import sys
import textwrap

import pytest

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=64)


LARGE_N_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import RequestOutputKind, SamplingParams
    from minivllm.v1.engine.async_llm import AsyncLLM

    async def stream(llm, n):
        done = set()
        params = SamplingParams(n=n, max_tokens=1, seed=3, output_kind=RequestOutputKind.DELTA)
        async for out in llm.generate("hi", params, "big"):
            done.update(c.index for c in out.outputs if c.finish_reason is not None)
        return done

    if __name__ == "__main__":
        ckpt = sys.argv[1]
        llm = LLM(ckpt, dtype="float32", max_model_len=64)
        out = llm.generate("hi", SamplingParams(n=4000, max_tokens=1, seed=3), use_tqdm=False)
        indices = sorted(c.index for c in out[0].outputs)
        print("sync", type(llm.llm_engine.engine_core).__name__, indices == list(range(4000)))
        llm.llm_engine.shutdown()
        allm = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, dtype="float32", max_model_len=64),
                                         enable_multiprocessing=True)
        print("async", type(allm.engine_core).__name__, asyncio.run(stream(allm, 3000)) == set(range(3000)))
        allm.shutdown()
""")


@pytest.mark.slow  # 20 s on a 2-core CPU; `make test-slow`
def test_thousands_of_samples_complete_through_the_process_split(ckpt, tmp_path):
    # With ZMQ's default high-water mark (1000) the client's ROUTER dropped child requests past ~2000 queued
    # ones and generate() waited forever (the AsyncLLM at n=3000; the LLM at n=20000). A subprocess with a
    # timeout makes a regression fail instead of hanging the suite.
    script = tmp_path / "large_n.py"
    script.write_text(LARGE_N_SCRIPT)
    env = {**os.environ, "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, str(script), ckpt], env=env, capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"n=4000 / n=3000 did not complete within 300 s (messages lost?): {e.stdout!r}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sync SyncMPClient True" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "async AsyncMPClient True" in r.stdout, r.stdout + r.stderr[-2000:]


GOOD = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

TOO_BIG = [  # an int field beyond what msgpack carries, as a kwarg
    dict(top_k=2**70), dict(stop_token_ids=[2**70]), dict(logit_bias={2**70: 1.0}),
    dict(logit_bias={str(2**70): 1.0}),
    dict(logit_bias={"9" * 5000: 1.0}), dict(n=2**64), dict(max_tokens=2**64), dict(logprobs=2**64),
    dict(prompt_logprobs=-2**63 - 1), dict(min_tokens=2**70, max_tokens=None), dict(seed=2**64),
]


@pytest.mark.parametrize("kwargs", TOO_BIG, ids=lambda kw: next(iter(kw)))
def test_ints_beyond_64_bits_are_value_errors_naming_the_field(llm, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
    # the same value set after construction is caught before the request is serialized
    sp = SamplingParams(max_tokens=2)
    for k, v in kwargs.items(): setattr(sp, k, v)
    with pytest.raises(ValueError, match=name):
        llm.generate("hello", sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("hello", GOOD, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_largest_64_bit_values_still_work(llm):
    params = SamplingParams(max_tokens=2, top_k=2**63 - 1, seed=2**64 - 1, ignore_eos=True)
    out = llm.generate("hello", params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="priority"):
        llm.llm_engine.add_request("p", "hello", GOOD, priority=2**70)


def test_child_seeds_near_the_top_of_the_range_wrap(llm):
    # n=4 with seed 2**64 - 1: children get 2**64 - 1, 0, 1, 2 (modulo 2**64) instead of an overflow
    params = SamplingParams(n=4, seed=2**64 - 1, max_tokens=3, temperature=1.0, ignore_eos=True)
    first = [c.token_ids for c in llm.generate("hello", params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate("hello", params, use_tqdm=False)[0].outputs]
    assert len(first) == 4 and first == again
    # child 1 (seed 0) samples what a seed=0 request samples
    solo = llm.generate("hello", SamplingParams(seed=0, max_tokens=3, temperature=1.0, ignore_eos=True),
                        use_tqdm=False)
    assert first[1] == solo[0].outputs[0].token_ids


NOT_FINITE = [dict(temperature=math.inf), dict(temperature=math.nan), dict(temperature=-math.inf),
              dict(temperature=2.5), dict(repetition_penalty=math.inf)]


@pytest.mark.parametrize("kwargs", NOT_FINITE, ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))}")
def test_temperature_must_be_finite_and_in_range(llm, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name) as e:
        SamplingParams(**kwargs)
    if name == "temperature": assert "[0, 2]" in str(e.value)
    sp = SamplingParams(max_tokens=2)
    for k, v in kwargs.items(): setattr(sp, k, v)
    with pytest.raises(ValueError, match=name):
        llm.generate("hello", sp, use_tqdm=False)
    out = llm.generate("hello", SamplingParams(temperature=2.0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs) == 1


BAD_SETTINGS = [(dict(block_size=7), ["block_size", "power of two", "1, 8, 16"]),
                (dict(block_size=512), ["block_size", "256"]), (dict(seed="abc"), ["seed", "int"]),
                (dict(seed=-1), ["seed", "2**32"]), (dict(seed=2**32), ["seed", "2**32"])]


@pytest.mark.parametrize("kwargs,words", BAD_SETTINGS)
def test_engine_settings_are_refused_up_front(ckpt, kwargs, words, monkeypatch):
    # refused before the model is even looked at: no engine, no model loading
    import minivllm.engine.arg_utils as arg_utils
    monkeypatch.setattr(arg_utils.EngineArgs, "resolve_model_path",
                        lambda self: pytest.fail("went on to start-up"))
    with pytest.raises(ValueError) as e:
        LLM(ckpt, dtype="float32", max_model_len=64, **kwargs)
    for w in words: assert w in str(e.value), str(e.value)


def _first_new_token_prompt(llm, k):
    "A prompt whose greedy token k (ignoring EOS) appears for the first time there, and those k + 1 tokens."
    for prompt in ["the cat", "hello world", "a b c", "one two", "x", "tiny model"]:
        base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=k + 1, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        if base[k] not in base[:k]: return prompt, base
    pytest.skip("no prompt whose greedy token is new at that position")


def test_eos_as_the_last_allowed_token_finishes_with_stop(llm):
    # vLLM's check_stop tests EOS and stop_token_ids before the length limits (after min_tokens)
    prompt, base = _first_new_token_prompt(llm, 2)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[base[2]]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (base, "stop", base[2])
    # the model's EOS: make the third greedy token this request's EOS id
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3)
    request = engine.input_processor.process_inputs("eos-last", prompt, params)
    request.eos_token_id = base[2]
    engine.add_request("eos-last", request, request.sampling_params)
    finished = []
    while engine.has_unfinished_requests(): finished += [o for o in engine.step() if o.finished]
    (final,) = finished
    assert final.outputs[0].token_ids == base and final.outputs[0].finish_reason == "stop"
    # a plain token in the last place is still a length cap, and min_tokens still holds a stop back
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    # (the sampler masks the stop token for the third token, so a different one is chosen: a length cap)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3, ignore_eos=True,
                                              stop_token_ids=[base[2]]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids[:2] == base[:2] and out.token_ids[2] != base[2]


def _serving_benchmark():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("chunked", [False, True])
def test_serving_benchmark_counts_a_stream_without_done_as_failed(chunked):
    import asyncio
    import json
    bench = _serving_benchmark()
    events = [b"data: " + json.dumps({"choices": [{"text": w}]}).encode() + b"\n\n" for w in ("Hel", "lo")]

    async def serve(reader, writer, finish: bool):
        while (await reader.readline()) not in (b"\r\n", b""): pass
        await reader.readexactly(2)  # the body: {}
        body = events + ([b"data: [DONE]\n\n"] if finish else [])
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        if chunked:
            writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
            for e in body: writer.write(b"%x\r\n%s\r\n" % (len(e), e))
            if finish: writer.write(b"0\r\n\r\n")   # a server that dies sends no final chunk
        else:
            writer.write(head + b"Connection: close\r\n\r\n" + b"".join(body))
        await writer.drain()
        writer.close()

    async def one(finish: bool):
        server = await asyncio.start_server(lambda r, w: serve(r, w, finish), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await bench.stream_request("127.0.0.1", port, "/v1/completions", {}, None, 0)

    ok, cut = asyncio.run(one(True)), asyncio.run(one(False))
    assert ok.ok and ok.text == "Hello" and not ok.error
    assert not cut.ok and "[DONE]" in cut.error and cut.text == "Hello"
    summary = bench.summarize([ok, cut], 1.0)
    assert (summary["successful_requests"], summary["failed_requests"]) == (1, 1)
