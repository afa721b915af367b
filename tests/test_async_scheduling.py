"""Async scheduling (AsyncScheduler + two batches in flight) gives the same greedy tokens as synchronous
scheduling: prefills of many lengths, chunked prefill, preemptions (a small KV pool), stop strings and
structured outputs; and the engine really schedules step N+1 before step N's output is processed."""
import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.core.sched.async_scheduler import AsyncScheduler


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _workload():
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 3 + 7 * i + 5 + 11 * i))} for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 4), ignore_eos=True) for i in range(10)]
    return prompts, params


def _run(ckpt, async_scheduling, **kw):
    llm = LLM(ckpt, dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=64,
              async_scheduling=async_scheduling, **kw)
    try:
        core = llm.llm_engine.engine_core.engine_core
        prompts, params = _workload()
        outs = llm.generate(prompts, params, use_tqdm=False)
        stop = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=12, stop=["e"]), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], stop[0].outputs[0].text, core
    finally:
        llm.llm_engine.shutdown()


def test_async_equals_sync(ckpt):
    sync, sync_stop, core = _run(ckpt, False)
    assert core.batch_queue is None
    got, got_stop, core = _run(ckpt, True)
    assert isinstance(core.scheduler, AsyncScheduler) and core.batch_queue_size == 2
    assert got == sync and got_stop == sync_stop


def test_async_equals_sync_with_preemptions(ckpt):
    sync, _, core_s = _run(ckpt, False, num_gpu_blocks_override=12)
    got, _, core_a = _run(ckpt, True, num_gpu_blocks_override=12)
    assert core_a.scheduler.num_preemptions > 0
    assert got == sync


def test_step_n_plus_1_is_scheduled_before_step_n_is_processed(ckpt):
    llm = LLM(ckpt, dtype="float32", max_model_len=128, async_scheduling=True)
    try:
        core = llm.llm_engine.engine_core.engine_core
        trace = []
        schedule, update = core.scheduler.schedule, core.scheduler.update_from_output

        def traced_schedule():
            so = schedule()
            trace.append(("schedule", so.total_num_scheduled_tokens))
            return so

        def traced_update(so, mro):
            trace.append(("update", so.total_num_scheduled_tokens))
            return update(so, mro)

        core.scheduler.schedule, core.scheduler.update_from_output = traced_schedule, traced_update
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        kinds = [k for k, n in trace if n > 0]
        assert kinds[:3] == ["schedule", "schedule", "update"]  # two steps in flight before the first output
    finally:
        llm.llm_engine.shutdown()


def test_structured_output_under_async_scheduling(ckpt, monkeypatch):
    # Sampled tokens are compared across two engines, so both must compute the same logits bit for bit.
    # The decoder's linears use the C GEMM (one summation order per output element, whatever the rows around
    # it: kernels chapter 04; tuning off, or a fresh measurement could pick another kernel per row bucket).
    # The LM head is torch's matmul, whose float32 rounding depends on the batch's row count; the two
    # schedulers need not run the same rows step by step (async schedules a finishing request once more),
    # and a flipped near-tie once gave '42-000' against '42-005'. So the comparison runs one request at a
    # time (max_num_seqs=1: every forward has the same rows in both modes), and the concurrent run checks
    # that the grammar held for every request while its previous token was still in flight.
    monkeypatch.setenv("MINIVLLM_CPU_GEMM_TUNING", "0")
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", "1")
    so = StructuredOutputsParams(regex=r"[0-9]{2}-[0-9]{3}")
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, structured_outputs=so)
    prompts = [f"p{i}" for i in range(4)]
    outs = {}
    for mode, max_num_seqs in ((False, 1), (True, 1), (True, 256)):
        llm = LLM(ckpt, dtype="float32", max_model_len=128, async_scheduling=mode, max_num_seqs=max_num_seqs)
        try:
            outs[mode, max_num_seqs] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    import re

    for key, texts in outs.items():
        assert all(re.fullmatch(r"[0-9]{2}-[0-9]{3}", t) for t in texts), (key, texts)
    assert outs[True, 1] == outs[False, 1]


def test_abort_during_a_step_drops_its_output(ckpt):
    "An abort the input thread queued while a step ran is applied before that step's output (aborts_queue)."
    llm = LLM(ckpt, dtype="float32", max_model_len=128)
    try:
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        rid = engine.add_request("a", {"prompt_token_ids": list(range(5, 40))},
                                 SamplingParams(max_tokens=50, ignore_eos=True))
        core.step()  # prefill + first token
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() < pool.num_gpu_blocks - 1
        core.aborts_queue.put_nowait([rid])  # arrives "during" the next step
        outputs, _ = core.step()
        assert not [o for eco in outputs.values() for o in eco.outputs if o.request_id == rid]
        assert rid not in core.scheduler.requests
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    finally:
        llm.llm_engine.shutdown()
