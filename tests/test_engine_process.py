"""The engine core in its own process (ZMQ + msgpack): same greedy outputs as in-process, utility calls, and a
dead engine process is reported as EngineDeadError within seconds (sync and asyncio clients)."""
import asyncio
import os
import signal
import time

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import EngineDeadError
from minivllm.v1.engine.core_client import EngineCoreClient
from minivllm.v1.engine.input_processor import InputProcessor
from minivllm.v1.executor.abstract import Executor

PROMPTS = ["hello world", "the cat sat on the mat", {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}, "a"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_process_split_gives_same_greedy_outputs(ckpt, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    inproc = [o.outputs[0].token_ids for o in LLM(ckpt, **kw).generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(ckpt, **kw)
    client = llm.llm_engine.engine_core
    assert type(client).__name__ == "SyncMPClient" and client.proc.is_alive()
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == inproc
        # again, with prefix-cache hits, and a utility round trip
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == inproc
        assert client.get_num_unfinished_requests() == 0
        assert client.reset_prefix_cache() is True
        # a killed engine process makes a waiting generate() raise within seconds
        os.kill(client.proc.pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(EngineDeadError, match="signal 9"):
            llm.generate(PROMPTS, params, use_tqdm=False)
        assert time.monotonic() - t < 5
    finally:
        llm.llm_engine.shutdown()
    assert not client.proc.is_alive()


def test_engine_start_failure_is_reported(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")   # fails in the engine process
    vllm_config = EngineArgs(model=path, dtype="float32", max_model_len=128).create_engine_config()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="initialization failed"):
        EngineCoreClient.make_client(True, False, vllm_config, Executor.get_class(vllm_config), False)
    assert time.monotonic() - t < 120


def test_async_client_streams_and_detects_death(ckpt):
    vllm_config = EngineArgs(model=ckpt, dtype="float32", max_model_len=128).create_engine_config()
    from minivllm.transformers_utils.tokenizer import get_tokenizer
    ip = InputProcessor(vllm_config, get_tokenizer(ckpt))

    async def main():
        client = EngineCoreClient.make_client(True, True, vllm_config, Executor.get_class(vllm_config), False)
        try:
            req = ip.process_inputs("r", "hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
            await client.add_request_async(req)
            tokens = []
            while True:
                outs = await asyncio.wait_for(client.get_output_async(), 60)
                for o in outs.outputs:
                    tokens += o.new_token_ids
                    if o.finished: break
                else: continue
                break
            assert len(tokens) == 5
            assert await client.reset_prefix_cache_async() is True
            await client.add_request_async(ip.process_inputs("s", "hello", SamplingParams(max_tokens=100, ignore_eos=True)))
            os.kill(client.proc.pid, signal.SIGKILL)
            t = time.monotonic()
            with pytest.raises(EngineDeadError):
                while True: await asyncio.wait_for(client.get_output_async(), 10)
            assert time.monotonic() - t < 5
        finally:
            client.shutdown()

    asyncio.run(main())


_LONG_SCRIPT = """
import sys
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=256)
    print("PID", llm.llm_engine.engine_core.proc.pid, flush=True)
    while True: llm.generate(["hello"] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
"""


def _pid_alive(pid: int) -> bool:
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f: return f.read().split(")")[-1].split()[0] != "Z"
    except OSError: return False


def test_sigterm_of_an_llm_script_cleans_up(ckpt, tmp_path):
    """`kill <pid>` (SIGTERM: docker stop, systemd, timeout) of a script using `LLM` leaves no IPC socket files in
    $TMPDIR and no engine process, like Ctrl-C (the default SIGTERM action would skip every cleanup)."""
    import subprocess, sys
    tmpdir = tmp_path / "tmp"; tmpdir.mkdir()
    script = tmp_path / "long.py"; script.write_text(_LONG_SCRIPT)
    env = {**os.environ, "TMPDIR": str(tmpdir), "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), ckpt], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PID"), line
        engine_pid = int(line.split()[1])
        assert any(p.name.startswith("minivllm-") for p in tmpdir.iterdir())
        time.sleep(0.5)  # mid-generation
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM   # still dies of SIGTERM, after the cleanup
    finally:
        if proc.poll() is None: proc.kill()
    deadline = time.monotonic() + 15
    while _pid_alive(engine_pid) and time.monotonic() < deadline: time.sleep(0.1)
    assert not _pid_alive(engine_pid)
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("minivllm-")] == []
