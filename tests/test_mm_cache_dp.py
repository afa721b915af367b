"""Data parallel + images (issue 30, item 9): one front end, two engine-core processes, each of which would
have its own receiver cache. With the sender/receiver pair a repeated image routed to the other engine
arrived without its data and the request was aborted; as vLLM v0.15 does, DP > 1 falls back to a
`processor_only` cache in the front end (and none in the engines), so every request carries its tensors.

The same image in four requests over DP=2 (both engines serve some) gives the tokens of one instance.
"""
import asyncio

import numpy as np
import pytest
from PIL import Image

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.multimodal.cache import MultiModalProcessorOnlyCache
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
KW = dict(dtype="float32", block_size=4, max_model_len=512, kv_cache_memory_bytes=16 << 20)


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


PROMPTS = [f"<bos>Look at <start_of_image> number {w} and say" for w in ("one", "two", "three", "four")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))


def test_dp2_repeated_images_equal_one_instance(ckpt, monkeypatch):
    img = image(0)
    items = [{"prompt": p, "multi_modal_data": {"image": [img]}} for p in PROMPTS]
    ref = LLM(ckpt, **KW)
    try:
        expected = [o.outputs[0].token_ids for o in ref.generate(items, GREEDY, use_tqdm=False)]
    finally:
        ref.llm_engine.shutdown()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = EngineArgs(model=ckpt, data_parallel_size=2, **KW)
    llm = AsyncLLM.from_engine_args(args, enable_multiprocessing=True)
    client = llm.engine_core
    procs = [c.proc for c in client.clients]

    async def one(i):
        last = None
        async for out in llm.generate(items[i], GREEDY, f"dp-img{i}"):
            last = out
        return last.outputs[0].token_ids

    async def main():
        first = await one(0)  # the image is now in the front end's cache
        return [first] + list(await asyncio.gather(*(one(i) for i in range(1, len(items)))))

    loop = asyncio.new_event_loop()
    try:
        got = loop.run_until_complete(main())
        assert all(n > 0 for n in client.requests_per_engine), client.requests_per_engine
        assert got == expected
        assert isinstance(llm.input_processor.mm_processor.cache, MultiModalProcessorOnlyCache)
    finally:
        llm.shutdown()
        loop.close()
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)
