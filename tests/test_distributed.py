"""Distributed execution on the CPU (gloo): tensor and pipeline parallelism through worker processes.

- TP=2, PP=2 (Llama) and TP=2 x PP=2 (Qwen3; vLLM's rank layout over four workers) through the mp backend give
  the same greedy tokens as TP=1 on tiny float32 checkpoints;
- the sharded weights, all-gathered back over each TP group, equal the checkpoint's tensors;
- a worker killed mid-run: the engine fails fast naming the rank, and no worker process is left;
- TP=2 through Ray equals TP=1, a killed actor is named, and no Ray actor process is left after shutdown;
- DP=2 (two engine-core processes behind DPLBAsyncMPClient) serves a batch on both engines, outputs unchanged.
"""
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint

KW = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20)
PROMPTS = [{"prompt_token_ids": [5 + (7 * i + j) % 90 for j in range(n)]} for i, n in enumerate([3, 17, 9, 40, 1, 25])]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [5, 1, 9, 3, 12, 7]]


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    # the engine core stays in the test process (one spawn less); the workers are processes all the same
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def reference(arch: str, tmp_path_factory) -> tuple[str, list]:
    "(checkpoint, greedy tokens at TP=1 in-process)."
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
    old = os.environ.get("MINIVLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return path, generate(path)
    finally:  # put back what was there (conftest sets "0" for the whole suite): deleting it broke later files
        if old is None:
            del os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = old


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return reference("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return reference("qwen3", tmp_path_factory)


def generate(path, **kw):
    llm = LLM(path, **KW, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def executor_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor


def qkv_shape(worker) -> tuple[int, ...]:
    "(rows of this rank's fused qkv weight, its q heads, its KV heads, head size)."
    qkv = worker.get_model().model.layers[0].self_attn.qkv_proj
    return qkv.weight.shape[0], qkv.num_heads, qkv.num_kv_heads, qkv.head_size


def layer_range(worker) -> tuple[int, int]:
    return worker.get_model().model.start_layer, worker.get_model().model.end_layer


def gather_weights(worker) -> dict[str, torch.Tensor]:
    """On each TP worker: every sharded parameter all-gathered back to its checkpoint shape, by checkpoint name
    (fused qkv / gate_up split into their projections)."""
    from minivllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    out = {}
    for name, p in worker.get_model().named_parameters():
        mod = worker.get_model().get_submodule(name.rsplit(".", 1)[0])
        kind = type(mod).__name__
        if kind == "QKVParallelLinear":
            q, k, v = p.split([mod.num_heads * mod.head_size, *[mod.num_kv_heads * mod.head_size] * 2])
            step = mod.num_kv_head_replicas
            for short, t in (("q", q), ("k", k), ("v", v)):
                full = tp.all_gather(t.contiguous(), dim=0)
                if short != "q":  # a replicated KV head appears once per replica
                    full = torch.cat(full.chunk(tp.world_size)[::step])
                out[name.replace("qkv_proj", f"{short}_proj")] = full
        elif kind == "MergedColumnParallelLinear":
            for short, t in zip(("gate", "up"), p.chunk(2)):
                out[name.replace("gate_up_proj", f"{short}_proj")] = tp.all_gather(t.contiguous(), dim=0)
        elif kind == "RowParallelLinear" and p.ndim == 2:
            out[name] = tp.all_gather(p.contiguous(), dim=1)
        elif kind in ("VocabParallelEmbedding", "ParallelLMHead"):
            out[name] = tp.all_gather(p.contiguous(), dim=0)[: mod.num_embeddings]
        else:
            out[name] = p.clone()
    return out


def assert_gathered_equal_checkpoint(gathered: list[dict], path: str) -> None:
    "Each rank's gathered weights equal the checkpoint's; together the ranks hold all of it."
    ckpt = load_file(f"{path}/model.safetensors")
    seen = set()
    for rank_weights in gathered:
        assert set(rank_weights) <= set(ckpt), set(rank_weights) - set(ckpt)
        for name, t in rank_weights.items():
            torch.testing.assert_close(t, ckpt[name], rtol=0, atol=0, msg=name)
        seen |= set(rank_weights)
    assert seen == set(ckpt), set(ckpt) - seen


def test_tensor_parallel_2_equals_1_and_weights_gather_back(llama, monkeypatch):
    path, expected = llama
    monkeypatch.setenv("MINIVLLM_CPU_ONEDNN_GEMM", "0")  # the workers keep their plain weights to gather
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", "0")
    llm = LLM(path, tensor_parallel_size=2, **KW)
    try:
        executor = executor_of(llm)
        assert type(executor).__name__ == "MultiprocExecutor" and len(executor.workers) == 2
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
        shapes = executor.collective_rpc(qkv_shape)
        rows, heads, kv_heads, head_size = shapes[0]
        assert shapes[0] == shapes[1] and (heads, kv_heads) == (2, 1)   # 4 q and 2 KV heads, halved
        assert rows == (heads + 2 * kv_heads) * head_size
        gathered = executor.collective_rpc(gather_weights)
    finally:
        llm.llm_engine.shutdown()
    assert gathered[0].keys() == gathered[1].keys()
    assert_gathered_equal_checkpoint(gathered, path)


def test_pipeline_parallel_2_equals_1(llama):
    path, expected = llama
    llm = LLM(path, pipeline_parallel_size=2, **KW)
    try:
        executor = executor_of(llm)
        assert executor.max_concurrent_batches == 2 and executor.output_rank == 1
        assert executor.collective_rpc(layer_range) == [(0, 1), (1, 2)]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
    finally:
        llm.llm_engine.shutdown()


def test_tp2_x_pp2_equals_1_then_a_killed_worker_fails_fast(qwen3, monkeypatch):
    path, expected = qwen3
    monkeypatch.setenv("MINIVLLM_CPU_ONEDNN_GEMM", "0")
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", "0")
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **KW)
    executor = executor_of(llm)
    pids = [w.proc.pid for w in executor.workers]
    try:
        assert len(pids) == 4 and executor.output_rank == 2   # first rank of the last stage
        assert executor.collective_rpc(layer_range) == [(0, 1), (0, 1), (1, 2), (1, 2)]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
        assert_gathered_equal_checkpoint(executor.collective_rpc(gather_weights), path)
        result = {}

        def run():
            try:
                llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), use_tqdm=False)
            except Exception as e:
                result["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        while not scheduler.running and t.is_alive():   # mid-run: requests are being decoded
            time.sleep(0.01)
        os.kill(pids[3], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the engine hangs after a worker died"
        assert "rank 3" in str(result.get("error")), result
    finally:
        llm.llm_engine.shutdown()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"worker processes left: {alive}"


def test_ray_tensor_parallel_2_equals_1_and_leaves_no_actor(llama):
    path, expected = llama
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
        executor = executor_of(llm)
        try:
            assert type(executor).__name__ == "RayDistributedExecutor" and len(executor.workers) == 2
            pids = ray.get([w.get_pid.remote() for w in executor.workers])
            assert len(set(pids)) == 2 and os.getpid() not in pids
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
            os.kill(pids[1], signal.SIGKILL)   # an actor dies: named, and nothing more is sent
            while psutil.pid_exists(pids[1]) and psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.05)
            with pytest.raises(RuntimeError, match="rank 1 died"):
                executor.collective_rpc("check_health", timeout=60)
            with pytest.raises(RuntimeError, match="rank 1 died"):
                executor.check_health()
        finally:
            llm.llm_engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            executor.collective_rpc("check_health")
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if psutil.pid_exists(p)], "Ray actor processes left after shutdown"
    finally:
        ray.shutdown()


def test_async_scheduling_with_pipeline_parallel_is_refused(llama):
    path, _ = llama
    with pytest.raises(ValueError, match="async_scheduling with pipeline_parallel_size"):
        LLM(path, pipeline_parallel_size=2, async_scheduling=True, **KW)


def test_data_parallel_2_uses_both_engines_and_equals_1(llama):
    import asyncio

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.v1.engine.async_llm import AsyncLLM
    from minivllm.v1.engine.core_client_dp import DPLBAsyncMPClient

    path, expected = llama
    with pytest.raises(ValueError, match="data_parallel_size > 1 needs AsyncLLM"):
        LLM(path, data_parallel_size=2, **KW)   # offline LLM: one per data-parallel rank instead
    llm = AsyncLLM.from_engine_args(EngineArgs(model=path, data_parallel_size=2, **KW), enable_multiprocessing=True)
    client = llm.engine_core
    assert isinstance(client, DPLBAsyncMPClient) and len(client.clients) == 2
    procs = [c.proc for c in client.clients]

    async def one(i):
        last = None
        async for out in llm.generate(PROMPTS[i], PARAMS[i], f"dp{i}"):
            last = out
        return last.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    loop = asyncio.new_event_loop()
    try:
        assert all(p.is_alive() for p in procs) and len({p.pid for p in procs}) == 2
        assert loop.run_until_complete(main()) == expected
        assert client.requests_per_engine == [3, 3]   # the batch arrived at once: both engines got half
        assert client.num_in_flight == [0, 0] and not client.dp_engines_running()
    finally:
        llm.shutdown()
        loop.close()
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)
