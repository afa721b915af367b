"""Step traces (chapter 24c) and the engine's KV cache invariant checker (chapter 17a) on a tiny random model:
a traced run's per-step token counts add up to the prompt and output tokens, in-process and with the engine
core in its own process (which writes the file); tracing off installs nothing; a corrupted ref count is caught
after the step that follows it, naming that step."""
import os
import random
import tempfile
from pathlib import Path

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.core.kv_cache_invariants import KVCacheInvariantError
from minivllm.v1.engine.core import EngineCore
from minivllm.v1.engine.step_trace import load_step_trace, load_step_trace_header
from minivllm.v1.executor.uniproc_executor import UniProcExecutor
from minivllm.v1.request import Request


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def workload(n=6, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 70))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("multiprocess", ["0", "1"])
def test_traced_token_counts_add_up(ckpt, tmp_path, monkeypatch, multiprocess):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", multiprocess)
    path = tmp_path / "trace.jsonl"
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=48,
              enable_prefix_caching=False, trace_steps=str(path))
    try:
        prompts, params = workload()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()  # the engine core may run one more (empty) step first
    steps = load_step_trace(llm)
    header = load_step_trace_header(path)
    assert steps == load_step_trace(path)
    assert (header["pid"] != os.getpid()) == (multiprocess == "1")  # the engine core's process wrote it
    num_out = [len(o.outputs[0].token_ids) for o in outs]
    assert num_out == [p.max_tokens for p in params]
    # every prompt token is prefilled once; every output token but the last is fed back as a decode token
    assert sum(s.num_prefill_tokens for s in steps) == sum(map(len, prompts))
    assert sum(s.num_decode_tokens for s in steps) == sum(num_out) - len(prompts)
    assert sum(e[3] for s in steps for e in s.scheduled) == sum(num_out)
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 48  # chunked prefill
    external = sorted(o.request_id for o in outs)  # the engine core sees "<id>-<random suffix>"
    assert sorted(r[0].split("-")[0] for s in steps for r in s.new_requests) == external
    assert sorted(r.split("-")[0] for s in steps for r in s.finished) == external
    assert [s.step for s in steps] == list(range(len(steps)))
    assert all(s.execute_model_s > 0 and s.schedule_s > 0 and s.update_s > 0 for s in steps)
    assert all(0 <= s.kv_cache_usage <= 1 for s in steps) and steps[-1].kv_cache_usage == 0
    assert all(s.scheduled_encoder_inputs == {} for s in steps)
    assert all(b.start_s >= a.start_s + a.schedule_s for a, b in zip(steps, steps[1:]))


def test_prefix_cache_hits_are_traced(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # trace_steps=True's file lands in tmp_path
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, trace_steps=True)
    assert Path(llm.llm_engine.vllm_config.observability_config.trace_steps).parent == tmp_path
    shared = list(range(10, 42))  # two full blocks
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate({"prompt_token_ids": shared + [7, 8]}, sp, use_tqdm=False)
    llm.generate({"prompt_token_ids": shared + [9]}, sp, use_tqdm=False)
    steps = load_step_trace(llm)
    assert [s.prefix_cache_hit_tokens for s in steps if s.new_requests] == [0, 32]
    assert sum(s.num_prefill_tokens for s in steps) == 34 + 1  # the second prompt computed only its last token


def make_core(ckpt, **kw):
    config = EngineArgs(model=ckpt, dtype="float32", max_model_len=128, block_size=16, **kw).create_engine_config()
    return EngineCore(config, UniProcExecutor, log_stats=False)


def test_off_by_default_installs_nothing(ckpt, monkeypatch):
    monkeypatch.delenv("MINIVLLM_CHECK_INVARIANTS", raising=False)
    core = make_core(ckpt)
    try:
        assert core.step_tracer is None
        for obj, name in [(core.scheduler, "schedule"), (core.scheduler, "update_from_output"),
                          (core.model_executor, "execute_model"), (core.model_executor, "sample_tokens")]:
            assert name not in vars(obj), name  # the class's own method: no wrapper on the step path
    finally:
        core.shutdown()


def test_corrupted_ref_count_is_caught_with_its_step(ckpt, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CHECK_INVARIANTS", "1")
    core = make_core(ckpt)
    try:
        assert core.step_tracer is None  # the checker runs without a trace
        sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        for i in range(2):
            core.add_request(Request(f"r{i}", list(range(5, 45)), sp, block_hasher=core.request_block_hasher))
        for _ in range(3):  # steps 0, 1, 2 pass the checks
            core.step_fn()
        block = core.scheduler.kv_cache_manager.get_blocks("r0").blocks[0][1]
        block.ref_cnt += 1  # a leaked reference
        with pytest.raises(KVCacheInvariantError, match=rf"after step 3: block {block.block_id} has ref_cnt \d, but \d holders") as e:
            core.step_fn()
        assert "free queue (LRU first)" in str(e.value) and "r0: (block, ref_cnt)" in str(e.value)
    finally:
        core.shutdown()


def test_cli_trace_steps(ckpt, tmp_path, monkeypatch, capsys):
    "`minivllm generate --trace-steps FILE` writes the trace; `serve`'s flag reaches EngineArgs."
    from minivllm.entrypoints.cli.main import main, make_parser
    from minivllm.entrypoints.openai.cli_args import engine_args_from

    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = tmp_path / "cli.jsonl"
    assert main(["generate", "--model", ckpt, "--max-model-len", "64", "--max-tokens", "3", "--ignore-eos",
                 "--trace-steps", str(path), "hello"]) in (0, None)
    steps = load_step_trace(path)
    assert sum(e[3] for s in steps for e in s.scheduled) == 3
    args = make_parser()[0].parse_args(["serve", ckpt, "--trace-steps", str(path), "--distributed-executor-backend", "sim"])
    ea = engine_args_from(args)
    assert ea.trace_steps == str(path) and ea.distributed_executor_backend == "sim"
