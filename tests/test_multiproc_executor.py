"""MultiprocExecutor: the model in a worker process, RPCs over shared-memory MessageQueues.

- engine process + one worker process gives the same greedy outputs as the in-process path;
- collective_rpc(non_block=True) returns a Future; a blocking call behind a pending one gets its own reply;
- a worker that dies is reported (failure callback, check_health, the engine's EngineDeadError) within seconds;
- a worker that fails to start is named in the error;
- no /dev/shm segment is left behind after shutdown, even when a worker was killed;
- a worker whose engine process is SIGKILLed exits by itself (death pipe).
"""
import glob
import operator
import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest

from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import EngineDeadError
from minivllm.v1.executor.abstract import Executor
from minivllm.v1.executor.multiproc_executor import MultiprocExecutor


def shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/minivllm_*"))


def children(pid: int) -> list[tuple[int, str]]:
    "(pid, command line) of the live child processes of `pid`."
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit(): continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append((int(d), open(f"/proc/{d}/cmdline").read().replace("\0", " ")))
        except (OSError, ValueError, IndexError):
            continue
    return out


def sleep_then(worker, seconds: float, value):
    "An RPC (pickled by reference: the worker imports this module) that takes a while."
    time.sleep(seconds)
    return (worker.rank, value)


def fail(worker):
    raise KeyError("boom")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def mp_config(path, **parallel) -> VllmConfig:
    return VllmConfig(ModelConfig(path, dtype="float32"), CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 20),
                      SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128),
                      parallel_config=ParallelConfig(distributed_executor_backend="mp", **parallel),
                      device_config=DeviceConfig("cpu"))


KW = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20)
PROMPTS = [{"prompt_token_ids": [5 + (7 * i + j) % 90 for j in range(n)]} for i, n in enumerate([3, 17, 9, 40, 1, 25, 12, 60])]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [5, 1, 9, 3, 12, 7, 2, 6]]


@pytest.fixture(scope="module")
def expected(ckpt):
    "Greedy token ids of the in-process path (engine core and UniProcExecutor in this process)."
    llm = LLM(ckpt, **KW)
    assert type(llm.llm_engine.engine_core.engine_core.model_executor).__name__ == "UniProcExecutor"
    try: return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally: llm.llm_engine.shutdown()


def test_in_process_engine_with_worker_process_matches(ckpt, expected):
    before = shm_segments()
    llm = LLM(ckpt, distributed_executor_backend="mp", **KW)
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        assert isinstance(executor, MultiprocExecutor) and executor.workers[0].proc.is_alive()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
    finally:
        llm.llm_engine.shutdown()
    assert shm_segments() <= before and not executor.workers[0].proc.is_alive()


def test_engine_process_plus_worker_process_matches_in_process(ckpt, expected, monkeypatch):
    prompts, params, kw = PROMPTS, PARAMS, KW
    before = shm_segments()
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(ckpt, distributed_executor_backend="mp", **kw)
    client = llm.llm_engine.engine_core
    try:
        assert type(client).__name__ == "SyncMPClient" and client.proc.is_alive()
        workers = [c for c in children(client.proc.pid) if "resource_tracker" not in c[1]]
        assert len(workers) == 1, children(client.proc.pid)   # the engine-core process started one worker process (forked or spawned)
        assert len(shm_segments() - before) == 2               # rpc_broadcast_mq + the worker's response queue
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert [len(t) for t in got] == [5, 1, 9, 3, 12, 7, 2, 6]
        # the worker dies: the engine fails within seconds with EngineDeadError instead of hanging
        os.kill(workers[0][0], signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(prompts, params, use_tqdm=False)
        assert time.monotonic() - t < 30
        client.proc.join(10)
        assert not client.proc.is_alive()
    finally:
        llm.llm_engine.shutdown()
    assert shm_segments() <= before   # the engine core unlinked both queues, the killed worker's too


def test_collective_rpc_futures_errors_and_worker_death(ckpt):
    before = shm_segments()
    executor = Executor.get_class(mp_config(ckpt))(mp_config(ckpt))
    try:
        assert isinstance(executor, MultiprocExecutor)
        assert executor.output_rank == 0 and executor.max_concurrent_batches == 1
        (w,) = executor.workers
        assert w.proc.is_alive() and w.proc.pid != os.getpid()
        rank, local_rank, init_method = executor.collective_rpc(operator.attrgetter("rank", "local_rank", "distributed_init_method"))[0]
        assert (rank, local_rank) == (0, 0) and init_method.startswith("tcp://127.0.0.1:")
        fut = executor.collective_rpc(sleep_then, args=(0.3, "slow"), non_block=True)
        assert isinstance(fut, Future)
        # a blocking call while the future is pending must get its own reply, not the pending one's
        assert executor.collective_rpc(sleep_then, args=(0.0, "fast")) == [(0, "fast")]
        assert fut.result(timeout=30) == [(0, "slow")]
        assert executor.collective_rpc(sleep_then, args=(0.0, 7), unique_reply_rank=0) == (0, 7)
        fut = executor.collective_rpc(sleep_then, args=(0.0, 1), non_block=True, unique_reply_rank=0)
        assert fut.result(timeout=30) == (0, 1)
        with pytest.raises(KeyError, match="boom"):
            executor.collective_rpc(fail)
        with pytest.raises(NotImplementedError, match="no_such_method"):
            executor.collective_rpc("no_such_method", non_block=True).result(timeout=30)
        with pytest.raises(TimeoutError):
            executor.collective_rpc(sleep_then, args=(2.0, None), timeout=0.2)
        assert executor.collective_rpc(sleep_then, args=(0.0, "after")) == [(0, "after")]   # the late reply is dropped
    finally:
        executor.shutdown()
    assert shm_segments() <= before and not w.proc.is_alive()


def test_worker_death_fires_callback_and_check_health(ckpt):
    before = shm_segments()
    executor = MultiprocExecutor(mp_config(ckpt))
    try:
        executor.check_health()
        fired = threading.Event()
        executor.register_failure_callback(fired.set)
        (w,) = executor.workers
        pending = executor.collective_rpc(sleep_then, args=(30.0, None), non_block=True)
        os.kill(w.proc.pid, signal.SIGKILL)
        assert fired.wait(10)
        with pytest.raises(RuntimeError, match="VllmWorker-0.*signal 9"):
            pending.result(timeout=10)                      # a waiting reply is cancelled, not left hanging
        with pytest.raises(RuntimeError, match="VllmWorker-0"):
            executor.check_health()
        with pytest.raises(RuntimeError, match="died unexpectedly"):
            executor.collective_rpc("check_health")
        late = threading.Event()
        executor.register_failure_callback(late.set)        # registered after the death: called at once
        assert late.is_set()
    finally:
        executor.shutdown()
    assert shm_segments() <= before


def test_worker_start_failure_names_the_worker(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")   # fails in the worker
    before = shm_segments()
    with pytest.raises(RuntimeError, match="Worker VllmWorker-0 \\(rank 0\\) failed during start-up"):
        MultiprocExecutor(mp_config(path))
    assert shm_segments() <= before


def test_world_size_above_one_picks_mp(ckpt):
    # tp x pp > 1 runs (tests/test_distributed.py); without a backend named it goes to worker processes
    cfg = EngineArgs(model=ckpt, tensor_parallel_size=2).create_engine_config()
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert Executor.get_class(cfg) is MultiprocExecutor


def test_worker_exits_when_the_engine_process_is_killed(ckpt, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(ckpt, distributed_executor_backend="mp", dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 20)
    client = llm.llm_engine.engine_core
    (worker_pid, _), = [c for c in children(client.proc.pid) if "resource_tracker" not in c[1]]
    try:
        os.kill(client.proc.pid, signal.SIGKILL)   # no shutdown code runs in the engine process
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{worker_pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
            try: os.waitpid(worker_pid, os.WNOHANG)   # not our child: ECHILD; just keep polling /proc
            except ChildProcessError: pass
        state = open(f"/proc/{worker_pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{worker_pid}") else "gone"
        assert state in ("gone", "Z"), state   # the death pipe told the orphaned worker to exit
    finally:
        llm.llm_engine.shutdown()
        try: os.kill(worker_pid, signal.SIGKILL)   # never leave a worker behind, even when the test fails
        except ProcessLookupError: pass
