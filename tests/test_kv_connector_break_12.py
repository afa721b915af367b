"""A twelfth try-to-break pass on the KV connectors and what they are combined with (issue 30).

1. Async scheduling: a request preempted while the step computing its last token was in flight was finished
   by that step's output but left in the waiting queue; the next `schedule()` admitted a freed request and
   the engine died (`KeyError` in `_update_after_schedule`). With any connector or none.
2. Two engines in one process, one with async scheduling, shared one module-global forward context.
"""

import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt_b12") / "llama"
    make_tiny_checkpoint("llama", str(path))
    return str(path)


def _greedy(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_async_preemption_while_the_last_token_is_in_flight(llama_dir, monkeypatch):
    """1. 8 prompts on 10 blocks with async scheduling: preemptions happen while tokens are in flight; some
    preempted request's in-flight step is its last. The engine survives, every request gets `max_tokens`
    tokens, equal to a run with room for all, and every block comes back."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = dict(dtype="float32", max_model_len=256, block_size=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(14, 40))] for _ in range(8)]
    max_tokens = [rng.randrange(2, 30) for _ in prompts]
    ref_llm = LLM(llama_dir, **kw)
    try:
        ref = _greedy(ref_llm, prompts, max_tokens)
    finally:
        ref_llm.llm_engine.shutdown()
    llm = LLM(llama_dir, **kw, num_gpu_blocks_override=10, async_scheduling=True)
    try:
        got = _greedy(llm, prompts, max_tokens)  # was: KeyError from the scheduler, engine dead
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.num_preemptions >= 1
        assert got == ref
        assert not scheduler.requests and not scheduler.waiting and not scheduler.running
        assert scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.llm_engine.shutdown()


def test_two_in_process_engines_one_async_keep_their_own_forward_context(llama_dir, monkeypatch):
    """2. An async engine runs its forward on its executor's thread while a second engine in the same process
    steps on the main thread (as the in-process P/D tests run a producer and a consumer). The forward context
    was one module global: each engine's layers read the other's metadata (`a slot is >= ...`, or wrong KV).
    Now it is per thread: both engines' greedy outputs equal a run of each alone."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = dict(dtype="float32", max_model_len=256, block_size=16)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 60))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(llama_dir, **kw)
    try:
        ref = _greedy(alone, prompts, [24] * len(prompts))
    finally:
        alone.llm_engine.shutdown()
    a = LLM(llama_dir, **kw, async_scheduling=True, num_gpu_blocks_override=64)
    b = LLM(llama_dir, **kw, num_gpu_blocks_override=40)
    try:
        ea, eb = a.llm_engine, b.llm_engine
        for i, p in enumerate(prompts):
            ea.add_request(f"a{i}", {"prompt_token_ids": p}, params)
            eb.add_request(f"b{i}", {"prompt_token_ids": p}, params)
        done: dict[str, list[int]] = {}
        for _ in range(400):
            if not (ea.has_unfinished_requests() or eb.has_unfinished_requests()):
                break
            for out in ea.step() + eb.step():  # b's forward runs while a's is in flight on a's thread
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert [done.get(f"a{i}") for i in range(len(prompts))] == ref
        assert [done.get(f"b{i}") for i in range(len(prompts))] == ref
    finally:
        a.llm_engine.shutdown()
        b.llm_engine.shutdown()
