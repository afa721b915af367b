"""An `AsyncLLM` (multiprocess, the default) dropped without `shutdown()` after its event loop ended kept its
engine process until the interpreter exited (last session's "left alone" list): the async client's
`EngineCoreMonitor` thread, blocked on the engine's sentinel, held the client through its closure, so the
client's finalizer (which stops the engine process) never ran. Two drops left 2 live engine processes. The
thread now holds it by a weak reference (chapter 29e), as the sync client's output thread does.
"""

import asyncio
import gc
import time

import psutil
import pytest

from minivllm import SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _live_children() -> list[psutil.Process]:
    kids = psutil.Process().children(recursive=True)
    return [c for c in kids if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def _one_run(ckpt) -> list[int]:
    "An AsyncLLM in its own process split, one request on its own event loop, never shut down."
    args = EngineArgs(model=ckpt, dtype="float32", max_model_len=64)
    engine = AsyncLLM.from_engine_args(args, enable_multiprocessing=True)

    async def main() -> list[int]:
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        last = None
        async for out in engine.generate({"prompt_token_ids": [1, 2, 3]}, sp, "r"):
            last = out
        return last.outputs[0].token_ids

    return asyncio.run(main())


def test_a_dropped_async_llm_stops_its_engine_process(ckpt):
    before = {p.pid for p in _live_children()}
    tokens = [_one_run(ckpt) for _ in range(2)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3
    gc.collect()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the finalizer signals the engine, which exits within seconds
        left = [p for p in _live_children() if p.pid not in before]
        if not left:
            break
        time.sleep(0.2)
    assert left == [], f"{len(left)} engine processes outlived their dropped AsyncLLM"
