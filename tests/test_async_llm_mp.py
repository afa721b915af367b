"""AsyncLLM over a real engine-core process (the default layout, as in vLLM): concurrent DELTA streams equal the
offline `LLM`'s greedy tokens, a stop string finished in the front end is aborted in the engine, a cancelled consumer
frees its request and KV blocks in the engine, a killed engine process fails a waiting generate() with
EngineDeadError, and `minivllm serve` answers through the process split. (Scripts without a `__main__` guard: fine
under fork, the Linux default, and refused with a clear error under spawn: tests/test_mp_method.py.) Tiny
random-weight Qwen2; a few tokens per request."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM, EngineDeadError

KW = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=32)
PROMPTS = ["hello world", "the cat sat on the mat", {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}, "a"]
D = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def offline(ckpt):
    "Greedy outputs of the offline LLM (in-process core, see conftest): 12 tokens per prompt."
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(ckpt, **KW)
    try: return llm.generate(PROMPTS, params, use_tqdm=False)
    finally: llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def loop():
    "One event loop for the module: an AsyncLLM belongs to the loop of its first generate()."
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def mp_llm(ckpt, loop):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, **KW), enable_multiprocessing=True)
    assert type(llm.engine_core).__name__ == "AsyncMPClient" and llm.engine_core.proc.is_alive()
    yield llm
    llm.shutdown()
    assert not llm.engine_core.proc.is_alive()


async def collect(llm, rid, prompt, params, stop_after=None):
    "Token ids and text of one stream, from its DELTA outputs; the last output."
    tokens, text, last = [], "", None
    async for out in llm.generate(prompt, params, rid):
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
        last = out
        if stop_after is not None and len(tokens) >= stop_after: break
    return tokens, text, last


async def wait_engine_idle(llm, timeout=30.0):
    "Poll the engine process (utility call) until it runs no request; the deadline only stops a broken test hanging."
    deadline = time.monotonic() + timeout
    while (n := await llm.engine_core.call_utility_async("get_num_unfinished_requests")) != 0:
        assert time.monotonic() < deadline, f"{n} requests still in the engine"
        await asyncio.sleep(0.01)


def test_concurrent_delta_streams_equal_offline_greedy(mp_llm, offline, loop):
    async def main():
        params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True, output_kind=D) for i in range(len(PROMPTS))]
        return await asyncio.gather(*(collect(mp_llm, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))))
    results = loop.run_until_complete(main())
    for i, (tokens, text, last) in enumerate(results):
        want = offline[i].outputs[0]
        assert tokens == want.token_ids[:4 + 2 * i]
        assert last.finished and last.outputs[0].finish_reason == "length"
    # the full 12 tokens decode to the offline text
    tokens, text, _ = loop.run_until_complete(collect(mp_llm, "full", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=D)))
    assert tokens == offline[1].outputs[0].token_ids and text == offline[1].outputs[0].text
    assert mp_llm.get_num_unfinished_requests() == 0


def test_stop_string_is_aborted_in_the_engine(mp_llm, offline, loop):
    text = offline[1].outputs[0].text
    k = next((k for k in range(len(text) // 3, len(text) - 1) if text[k:k + 2].strip() and "\ufffd" not in text[k:k + 2]), None)
    if k is None: pytest.skip(f"no usable stop string in the tiny model's text {text!r}")
    stop = text[k:k + 2]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop], output_kind=D)

    async def main():
        _, got, last = await collect(mp_llm, "stop", PROMPTS[1], params)
        # The engine knew nothing of the stop string and would run 400 tokens: the output handler sent the abort
        # before this stream saw its last output, and the utility call below travels the same socket after it.
        assert await mp_llm.engine_core.call_utility_async("get_num_unfinished_requests") == 0
        return got, last, await mp_llm.reset_prefix_cache()
    got, last, reset = loop.run_until_complete(main())
    assert got == text[:text.find(stop)] and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert reset is True                        # only possible once every KV block is back in the pool


def test_cancelled_consumer_aborts_in_the_engine(mp_llm, loop):
    async def main():
        seen = asyncio.Event()
        async def consume():
            async for _ in mp_llm.generate("x y z", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=D), "cancel-me"):
                seen.set()
        task = asyncio.create_task(consume())
        await seen.wait()
        assert await mp_llm.engine_core.call_utility_async("get_num_unfinished_requests") == 1
        assert await mp_llm.reset_prefix_cache() is False          # the running request holds blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError): await task
        # closing a generator early (break) takes the same path
        tokens, _, last = await collect(mp_llm, "break-me", "hello", SamplingParams(max_tokens=400, ignore_eos=True, output_kind=D), stop_after=2)
        assert len(tokens) >= 2 and not last.finished
        await wait_engine_idle(mp_llm)
        return await mp_llm.reset_prefix_cache()
    assert loop.run_until_complete(main()) is True
    assert mp_llm.get_num_unfinished_requests() == 0 and not mp_llm.output_processor.has_unfinished_requests()


def test_killed_engine_fails_waiting_generate(ckpt):
    async def main():
        llm = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, **KW), enable_multiprocessing=True)
        try:
            await llm.check_health()
            killed_at = None
            with pytest.raises(EngineDeadError, match="signal 9"):
                async for _ in llm.generate("hello", SamplingParams(max_tokens=450, ignore_eos=True, output_kind=D), "doomed"):
                    if killed_at is None:
                        os.kill(llm.engine_core.proc.pid, signal.SIGKILL)
                        killed_at = time.monotonic()
            assert time.monotonic() - killed_at < 5
            with pytest.raises(EngineDeadError): await llm.check_health()
            assert llm.errored and not llm.is_running
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("again", SamplingParams(max_tokens=2), "after"): pass
        finally:
            llm.shutdown()
    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try: return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError: return []


def _env_default() -> dict:
    "This environment without the conftest's in-process switch: the default layout (process split)."
    return {k: v for k, v in os.environ.items() if k != "MINIVLLM_ENABLE_V1_MULTIPROCESSING"}


def test_minivllm_serve_answers_through_the_process_split(ckpt, offline):
    exe = Path(sys.executable).with_name("minivllm")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "minivllm.entrypoints.cli.main"]
    port = _free_port()
    proc = subprocess.Popen(cmd + ["serve", ckpt, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
                                   "--dtype", "float32", "--max-model-len", "512", "--uvicorn-log-level", "warning"],
                            env=_env_default(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    engines = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"server exited: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "server did not come up"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200: break
            except OSError: time.sleep(0.5)
        engines = _children(proc.pid)
        assert engines, "no engine-core process under the server"
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r: res = json.loads(r.read())
        assert res["choices"][0]["text"] == offline[1].outputs[0].text
        assert res["usage"]["completion_tokens"] == 12
    finally:
        proc.send_signal(signal.SIGINT)
        try: proc.wait(30)
        except subprocess.TimeoutExpired: proc.kill(); proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in engines) and time.monotonic() < deadline: time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in engines), "engine process outlived the server"

