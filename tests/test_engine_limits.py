"""Limits of the engine side, from issue 12: one request with thousands of samples completes through the process
split (the ZMQ sockets queue every message instead of dropping some and hanging); integers and floats outside what
msgpack or the sampler can carry are ValueErrors naming the field; engine settings that cannot work (`block_size=7`,
`seed="abc"`) are refused up front; EOS as the last allowed token finishes with "stop"; and the serving benchmark
counts a stream without `[DONE]` as a failure. Tiny random-weight checkpoints, one token per request."""
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
        print("sync", type(llm.llm_engine.engine_core).__name__, sorted(c.index for c in out[0].outputs) == list(range(4000)))
        llm.llm_engine.shutdown()
        allm = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, dtype="float32", max_model_len=64),
                                         enable_multiprocessing=True)
        print("async", type(allm.engine_core).__name__, asyncio.run(stream(allm, 3000)) == set(range(3000)))
        allm.shutdown()
""")


def test_thousands_of_samples_complete_through_the_process_split(ckpt, tmp_path):
    # With ZMQ's default high-water mark (1000) the client's ROUTER dropped child requests past ~2000 queued ones
    # and generate() waited forever (the AsyncLLM at n=3000; the LLM at n=20000). A subprocess with a timeout makes
    # a regression fail instead of hanging the suite.
    script = tmp_path / "large_n.py"
    script.write_text(LARGE_N_SCRIPT)
    env = {**os.environ, "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, str(script), ckpt], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"n=4000 / n=3000 did not complete within 300 s (messages lost?): {e.stdout!r}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sync SyncMPClient True" in r.stdout and "async AsyncMPClient True" in r.stdout, r.stdout + r.stderr[-2000:]
