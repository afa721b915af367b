"""SimulatedExecutor (chapter 45d): the real scheduler on a virtual clock. Every request gets exactly its output
length under preemption and prefix caching with the KV invariants checked after every step; priority order is
honoured; a fitted cost model recovers known coefficients; LLM(simulate=...) and the 'sim' backend run through
the ordinary front end, in-process and with the engine core in its own process."""
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.step_trace import load_step_trace
from minivllm.v1.executor.abstract import Executor
from minivllm.v1.executor.simulated_executor import (SIM_TOKEN_ID, CostModel, SimRequest, SimulatedExecutor,
                                                     poisson_workload, simulate)

COST = CostModel(a=0.01, b=0.001, c=0.002, d=1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def args(ckpt, **kw):
    base = dict(model=ckpt, max_model_len=256, num_gpu_blocks_override=48, max_num_seqs=16, max_num_batched_tokens=128)
    return EngineArgs(**{**base, **kw})


def test_every_request_completes_under_pressure(ckpt, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CHECK_INVARIANTS", "1")
    wl = poisson_workload(300, rate=50.0, prompt_len=lambda r: r.randint(4, 150), output_len=lambda r: r.randint(1, 60),
                          seed=3)
    for k, r in enumerate(wl):  # a third share a 40-token system prompt
        if k % 3 == 0:
            r.prefix_group, r.prefix_len = 0, 40
    res = simulate(wl, args(ckpt), COST)
    assert sorted(r.num_output_tokens for r in res.latencies) == sorted(r.output_len for r in wl)
    assert res.num_preemptions > 0
    assert all(r.ttft_s > 0 and r.first_token_s <= r.last_token_s for r in res.latencies)
    assert res.total_s >= max(r.arrival_s for r in wl) - min(r.arrival_s for r in wl)


def test_cost_model_sets_the_clock(ckpt):
    # one request alone: a prefill step of 10 tokens, then 4 decode steps; context grows by one each step
    res = simulate([SimRequest(0.0, 10, 5)], args(ckpt), CostModel(a=1.0, b=0.1, c=0.01, d=0.001))
    expected = (1.0 + 10 * 0.1 + 10 * 0.001) + sum(1.0 + 0.01 + (10 + k) * 0.001 for k in range(1, 5))
    assert res.total_s == pytest.approx(expected)
    assert res.latencies[0].ttft_s == pytest.approx(1.0 + 1.0 + 0.01)


def test_priority_policy_serves_urgent_requests_first(ckpt):
    # a burst at t=0 with two priorities; one request fits at a time
    wl = [SimRequest(0.0, 20, 10, priority=k % 2) for k in range(10)]
    fcfs = simulate(wl, args(ckpt, max_num_seqs=1), COST)
    prio = simulate(wl, args(ckpt, max_num_seqs=1, scheduling_policy="priority"), COST)
    mean = lambda res, p: sum(r.ttft_s for r, w in zip(res.latencies, wl) if w.priority == p) / 5  # noqa: E731
    assert mean(prio, 0) < mean(fcfs, 0) and mean(prio, 1) > mean(fcfs, 1)
    assert prio.total_s == pytest.approx(fcfs.total_s)


def test_fit_recovers_coefficients_from_a_simulated_trace(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = tmp_path / "t.jsonl"
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_batched_tokens=64, simulate=COST, trace_steps=str(path))
    ex = llm.llm_engine.engine_core.engine_core.model_executor
    assert isinstance(ex, SimulatedExecutor) and ex.cost_model == COST
    prompts = [{"prompt_token_ids": list(range(5 + 30 * k, 5 + 30 * k + 3 + 7 * k))} for k in range(8)]
    sp = [SamplingParams(max_tokens=2 + 3 * k, ignore_eos=True, temperature=0.0) for k in range(8)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[SIM_TOKEN_ID] * (2 + 3 * k) for k in range(8)]
    steps = load_step_trace(path)
    # the trace's token counts are what the executor priced: refit its virtual step times from them
    fitted = CostModel.fit(steps, target=lambda s: COST.step_time(s.num_prefill_tokens, s.num_decode_tokens,
                                                                    s.num_context_tokens))
    for k in "abcd":
        assert getattr(fitted, k) == pytest.approx(getattr(COST, k), rel=1e-6, abs=1e-12)
    assert sum(COST.predict(steps)) == pytest.approx(ex.clock)


def test_sim_backend_in_its_own_process(ckpt, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert Executor.get_class(args(ckpt, distributed_executor_backend="sim").create_engine_config()) is SimulatedExecutor
    llm = LLM(ckpt, dtype="float32", max_model_len=256, distributed_executor_backend="sim")
    try:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == [SIM_TOKEN_ID] * 4
    finally:
        llm.llm_engine.engine_core.shutdown()
