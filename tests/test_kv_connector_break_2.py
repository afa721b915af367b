"""A fourth try-to-break pass on the KV connectors (issue 30): the configurations the earlier passes did not
attack, tensor and data parallel.

1. An engine that fails to start under `AsyncLLM` (here a P2P producer whose `kv_port` is taken) raised
   `AttributeError: 'AsyncMPClient' object has no attribute 'queue_task'` (its clean-up ran before the
   attribute existed) instead of the engine's own error; with `--data-parallel-size 2`, `DPLBAsyncMPClient`
   raised `AttributeError: ... '_tasks'` and left the first engine's process running.
2. Data parallel copies one config to every engine: the same `kv_transfer_config.engine_id` and `kv_port`.
   Two P2P producers bound the same port (DP=2 could not start) and two LMCache engines one lookup socket
   (each scheduler asked whichever engine bound last). As vLLM v0.15 does, engine i's `engine_id` gets
   `_dp<i>`, and its `kv_port` moves by i x `tensor_parallel_size`.
3. LMCache: a chunk that failed to load was recomputed but not stored again (it counted as loaded), so the
   next request with that prefix missed as well.
4. P2P with the producer at `--tensor-parallel-size 2` and the consumer at 1: the consumer pulled rank 0's
   heads only, refused them (layout), and the producer's rank 1 held the blocks until `abort_timeout_s`.
   The producer's parameters carry `tp_size` (as vLLM's NIXL connector's); a consumer with another size
   computes the prompt itself, warns naming `--tensor-parallel-size`, and releases every producer rank at once.
5. ExampleConnector and LMCache: the blocks a prompt computes in the step of a failed load (on whatever the
   failed block held) were stored; every later request with that prefix loaded them and gave other tokens,
   silently. Also when the request only hit the failed block in the local prefix cache (another request
   loaded it in the same step).
"""

import asyncio
import glob
import os
import socket
import tempfile
import time

import psutil
import pytest
from test_kv_connector_pd import _count_scheduled  # tests/ is on sys.path

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM

PROMPTS = [list(range(5, 5 + 37)), list(range(300, 300 + 20))]
MAX_TOKENS = 4
KW = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20,
          enable_prefix_caching=False)  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(path, **KW)
    try:
        return path, _greedy(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


def _store_one_damaged_block(path, kw, connector, tmp_path, first) -> dict:
    """Store `first`'s one block through `connector` in `tmp_path`, flip one bit of it on the disk; returns
    the kv_transfer_config that reads it back."""
    if connector == "ExampleConnector":
        extra, pattern = {"shared_storage_path": str(tmp_path)}, "*.safetensors"
    else:
        extra = {"chunk_size": 16, "local_cpu": False, "local_disk": str(tmp_path), "max_local_disk_size": 0.01}
        pattern = "*.kvchunk"
    kvt = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = LLM(path, **kw, kv_transfer_config=kvt)
    _greedy(llm, [first])
    llm.llm_engine.shutdown()
    (stored,) = tmp_path.glob(pattern)
    raw = bytearray(stored.read_bytes())
    raw[-3] ^= 0x10  # one bit of the stored block flipped on the disk
    stored.write_bytes(bytes(raw))
    return kvt


def _sp(params=None, max_tokens=MAX_TOKENS):
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _greedy(llm, prompts, params=None):
    sps = [_sp(p) for p in params or [None] * len(prompts)]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                         use_tqdm=False)]  # fmt: skip


def _port_pair() -> int:
    "A free port p of 127.0.0.1 with p + 1 free too (a TP=2 producer's two ranks)."
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            pass


def _engine_children() -> list:
    "Live (not zombie) child processes of this one, tests' helpers excluded (multiprocessing's tracker)."
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline()):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(before: set, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        left = [c for c in _engine_children() if c.pid not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# ---- 1. a failed start raises the engine's error and stops every engine ----


@pytest.mark.parametrize("dp", [1, 2])
def test_a_failed_engine_start_raises_its_own_error(llama, dp):
    before = {c.pid for c in _engine_children()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        if dp == 2:  # engine 0 starts (on port - 1, a free one), engine 1 finds its port taken
            port -= 1
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            except OSError:
                pytest.skip("the port below a free one is taken")
        kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port}
        args = EngineArgs(model=llama[0], data_parallel_size=dp, kv_transfer_config=kvt, **KW)
        with pytest.raises(RuntimeError, match="Address already in use"):  # before: AttributeError
            AsyncLLM.from_engine_args(args, enable_multiprocessing=True)
    assert _wait_gone(before) == []  # before (dp=2): engine 0 kept running


# ---- 2. data parallel: each engine its own engine_id and kv_port ----


def test_dp2_p2p_producers_serve_on_their_own_ports(llama):
    path, expected = llama
    port = _port_pair()
    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port}
    prod = AsyncLLM.from_engine_args(  # before: engine 1's bind failed, "Address already in use"
        EngineArgs(model=path, data_parallel_size=2, kv_transfer_config=kvt, **KW), enable_multiprocessing=True
    )
    cons = LLM(path, **KW, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                                               "kv_connector_extra_config": {"transfer_timeout_s": 10}})  # fmt: skip
    loop = asyncio.new_event_loop()

    async def prefill(i, prompt):
        last = None
        async for out in prod.generate({"prompt_token_ids": prompt}, _sp({"do_remote_decode": True}, 1), f"p{i}"):
            last = out
        return last.kv_transfer_params

    try:
        ids = {c.vllm_config.kv_transfer_config.engine_id for c in prod.engine_core.clients}
        assert len(ids) == 2
        async def both():
            return await asyncio.gather(*(prefill(i, p) for i, p in enumerate(PROMPTS)))

        params = loop.run_until_complete(both())
        assert prod.engine_core.requests_per_engine == [1, 1]
        assert sorted(p["remote_port"] for p in params) == [port, port + 1]
        counts = _count_scheduled(cons)
        got = [_greedy(cons, [p], [pp])[0] for p, pp in zip(PROMPTS, params)]
        assert got == expected
        assert sum(counts) == len(PROMPTS) * MAX_TOKENS  # pulled: only each prompt's last token computed
    finally:
        prod.shutdown()
        loop.close()
        cons.llm_engine.shutdown()


def test_dp2_lmcache_engines_have_their_own_lookup_sockets(llama):
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.lookup_client import (
        get_zmq_rpc_path_lmcache,
        lookup_engine_id,
    )

    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": 16, "max_local_cpu_size": 0.01}}  # fmt: skip
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=llama[0], data_parallel_size=2, kv_transfer_config=kvt, **KW), enable_multiprocessing=True
    )
    try:
        ids = [lookup_engine_id(c.vllm_config.kv_transfer_config) for c in llm.engine_core.clients]
        paths = [get_zmq_rpc_path_lmcache(e, 0).removeprefix("ipc://") for e in ids]
        assert len(set(paths)) == 2 and all(os.path.exists(p) for p in paths)  # before: one socket for both
    finally:
        llm.shutdown()


# ---- 3. LMCache: a chunk that failed to load is stored again by its recomputation ----


def test_lmcache_failed_chunk_is_stored_again(llama, tmp_path):
    path, expected = llama
    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": 16, "local_cpu": False, "local_disk": str(tmp_path),
                                         "max_local_disk_size": 0.01}}  # fmt: skip
    computed = []
    for round_ in range(4):  # cold, warm, damaged (recomputed), warm again
        if round_ == 2:
            for f in tmp_path.glob("*.kvchunk"):
                raw = bytearray(f.read_bytes())
                raw[-3] ^= 0x10
                f.write_bytes(bytes(raw))
        llm = LLM(path, **KW, kv_transfer_config=kvt)
        counts = _count_scheduled(llm)
        try:
            assert _greedy(llm, PROMPTS) == expected
        finally:
            llm.llm_engine.shutdown()
        computed.append(sum(counts))
    cold, warm, damaged, again = computed
    assert warm < cold and damaged > warm
    assert again == warm  # before: == cold, the recomputed chunks had not been stored


# ---- 4. P2P between different tensor-parallel sizes ----


@pytest.mark.parametrize("prod_tp,cons_tp", [(2, 1), (1, 2)])
def test_p2p_tp_mismatch_recomputes_and_frees_at_once(llama, prod_tp, cons_tp, caplog):
    path, expected = llama
    port = _port_pair()
    prod = LLM(path, tensor_parallel_size=prod_tp, **KW,
               kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port,
                                   "kv_connector_extra_config": {"abort_timeout_s": 120}})  # fmt: skip
    cons = LLM(path, tensor_parallel_size=cons_tp, **KW,
               kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                                   "kv_connector_extra_config": {"transfer_timeout_s": 10}})  # fmt: skip
    try:
        pool = prod.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        all_free = pool.get_num_free_blocks()
        params = []
        for p in PROMPTS:
            out = prod.generate([{"prompt_token_ids": p}], _sp({"do_remote_decode": True}, 1), use_tqdm=False)[0]
            params.append(out.kv_transfer_params)
            prod.llm_engine.step()  # registers the blocks with the producer's server
        got = [_greedy(cons, [p], [pp])[0] for p, pp in zip(PROMPTS, params)]
        assert got == expected  # computed by the consumer
        deadline = time.monotonic() + 10  # before: rank 1's blocks held for abort_timeout_s (120 s)
        while pool.get_num_free_blocks() < all_free and time.monotonic() < deadline:
            prod.llm_engine.step()
            time.sleep(0.01)
        assert pool.get_num_free_blocks() == all_free
        assert "--tensor-parallel-size" in caplog.text
        assert all(pp["tp_size"] == prod_tp for pp in params)  # as vLLM's NIXL connector's parameters
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


# ---- 5. a damaged stored block must not poison the blocks computed after it ----


@pytest.mark.parametrize("connector", ["ExampleConnector", "LMCacheConnectorV1"])
def test_a_failed_load_stores_nothing_computed_on_it(llama, tmp_path, connector):
    """A prompt whose first block loads from a damaged entry computes its later blocks in the same step, on
    whatever the failed block held. Those blocks were stored, and every later request with the prefix loaded
    them: other tokens than one instance's, silently (both connectors; at TP=2 with only rank 1's entry
    damaged too). A request's saves in the step of its failed load are dropped."""
    path = llama[0]
    first = list(range(5, 5 + 20))  # stores its one full block
    longer = first[:16] + list(range(400, 400 + 40))  # the same first block, then two more
    ref = LLM(path, **KW)
    want = _greedy(ref, [longer])
    ref.llm_engine.shutdown()
    kvt = _store_one_damaged_block(path, KW, connector, tmp_path, first)
    got = []
    for _ in range(3):  # the damaged load (recomputed), then two runs that load what was stored
        llm = LLM(path, **KW, kv_transfer_config=kvt)
        try:
            got += _greedy(llm, [longer])
        finally:
            llm.llm_engine.shutdown()
    assert got == want * 3  # before: the later runs loaded blocks computed on the damaged one


@pytest.mark.parametrize("connector", ["ExampleConnector", "LMCacheConnectorV1"])
def test_a_prefix_hit_on_a_failed_load_stores_nothing(llama, tmp_path, connector):
    """With prefix caching (the default), two prompts with the same damaged first block in one step: one loads
    it, the other hits that block in the local prefix cache and computes its own blocks on it. That second
    request had no failed load of its own, so its blocks were stored, and a later run of its prompt loaded
    them (ExampleConnector: other tokens). Saves of every request holding a failed block are dropped."""
    path = llama[0]
    first = list(range(5, 5 + 20))
    pair = [first[:16] + list(range(400, 440)), first[:16] + list(range(200, 240))]
    kw = dict(KW, enable_prefix_caching=True)
    ref = LLM(path, **kw)
    want = _greedy(ref, pair)
    ref.llm_engine.shutdown()
    kvt = _store_one_damaged_block(path, kw, connector, tmp_path, first)
    got = []
    for prompts in (pair, pair[:1], pair[1:]):  # both in one step (recomputed), then each alone, loaded
        llm = LLM(path, **kw, kv_transfer_config=kvt)
        try:
            got += _greedy(llm, prompts)
        finally:
            llm.llm_engine.shutdown()
    assert got == want * 2  # before (ExampleConnector): the prefix-hit request's stored blocks were wrong


# ---- 6. a worker killed mid-transfer leaves no file behind ----


def test_a_killed_worker_leaves_no_socket_file(llama, monkeypatch):
    """SIGKILL of one TP rank while a P2P consumer waits for a silent peer: the engine fails at once (the
    executor names the dead worker), and after shutdown nothing of the worker is left. Its response queue's
    ipc socket (`/tmp/minivllm-mq-*`, bound by the worker, which unlinks it on a clean exit) stayed, one file
    per killed worker; the executor now removes it."""
    import signal
    import threading

    import zmq

    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the workers are processes all the same
    path = llama[0]
    cons = LLM(path, tensor_parallel_size=2, **KW,
               kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                                   "kv_connector_extra_config": {"transfer_timeout_s": 60}})  # fmt: skip
    executor = cons.llm_engine.engine_core.engine_core.model_executor
    files = [w.worker_response_mq.local_subscribe_addr.removeprefix("ipc://") for w in executor.workers]
    assert all(os.path.exists(f) for f in files)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts the pulls, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_request_id": "r",
              "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": port}  # fmt: skip
    victim = executor.workers[1].proc
    threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL)).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="died unexpectedly"):
            _greedy(cons, [PROMPTS[0]], [params])
        assert time.monotonic() - t0 < 30  # the 60 s pull timeout did not have to pass
    finally:
        cons.llm_engine.shutdown()
        silent.close(0)
        ctx.term()
    assert [f for f in files if os.path.exists(f)] == []  # before: the killed rank's socket file stayed


def test_a_killed_lmcache_rank_leaves_no_lookup_socket(llama, monkeypatch):
    """LMCache at TP=2: each rank's lookup server binds `minivllm-lmcache-<engine>-<rank>.sock` and removes it
    on a clean exit; a SIGKILLed rank left its file (two such files from killed runs were in /tmp when this
    pass began). The scheduler side, which knows every rank's path, removes them at shutdown."""
    import signal

    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.lookup_client import (
        get_zmq_rpc_path_lmcache,
        lookup_engine_id,
    )

    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": 16, "max_local_cpu_size": 0.01}}  # fmt: skip
    llm = LLM(llama[0], tensor_parallel_size=2, **KW, kv_transfer_config=kvt)
    engine_id = lookup_engine_id(llm.llm_engine.vllm_config.kv_transfer_config)
    files = [get_zmq_rpc_path_lmcache(engine_id, r).removeprefix("ipc://") for r in range(2)]
    try:
        assert _greedy(llm, PROMPTS) == llama[1] and all(os.path.exists(f) for f in files)
        os.kill(llm.llm_engine.engine_core.engine_core.model_executor.workers[1].proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="died unexpectedly"):
            _greedy(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()
    assert [f for f in files if os.path.exists(f)] == []  # before: rank 1's file stayed


# ---- 7. a writer killed mid-save leaves a temporary file: the next engine removes it ----

_KILLED_WRITER = """
import os, sys, time
os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_connector.v1 import example_connector


def slow_save(tensors, filename, *args, **kwargs):
    with open(filename, "wb") as f:
        f.write(bytes(100))  # the first part reached the disk
    print("SAVING", flush=True)
    time.sleep(120)  # killed here


example_connector.save_file = slow_save
kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
       "kv_connector_extra_config": {"shared_storage_path": sys.argv[2]}}
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)
llm.generate([{"prompt_token_ids": list(range(5, 42))}], SamplingParams(max_tokens=2), use_tqdm=False)
"""


def test_a_killed_writers_temporary_file_is_swept(llama, tmp_path):
    """ExampleConnector writes a temporary file and renames it; a worker killed in between (SIGKILL, a crash)
    left `tmp*.tmp` in the shared folder forever (the LMCache disk tier sweeps its own). An engine starting
    on the folder removes those older than `stale_tmp_s` (60 s; the file is back-dated an hour here); a
    younger one may be another engine's save in progress. An age under 10 s is refused, by name."""
    import subprocess
    import sys

    storage = tmp_path / "kv"
    storage.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), llama[0], str(storage)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SAVING"
    finally:
        proc.kill()  # by its pid: the writer dies in mid-save
        proc.wait(30)
    left = [p for p in storage.iterdir() if p.name.endswith(".tmp")]
    assert left  # what the killed writer left
    for p in left:
        os.utime(p, (time.time() - 3600, time.time() - 3600))  # an hour ago: its writer is long gone
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(storage), "stale_tmp_s": 0}}  # fmt: skip
    refused = r"kv_connector_extra_config\['stale_tmp_s'\] must be a number of seconds >= 10"
    with pytest.raises(ValueError, match=refused):
        LLM(llama[0], **KW, kv_transfer_config=kvt)  # 0 would delete other engines' saves in progress
    assert [p.name for p in storage.iterdir() if p.name.endswith(".tmp")]  # nothing was swept by the refusal
    kvt["kv_connector_extra_config"]["stale_tmp_s"] = 60
    llm = LLM(llama[0], **KW, kv_transfer_config=kvt)
    llm.llm_engine.shutdown()
    assert [p.name for p in storage.iterdir() if p.name.endswith(".tmp")] == []  # before: it stayed


def test_ec_connector_sweeps_a_killed_writers_temporary_file(tmp_path):
    "The same for ECExampleConnector, whose temporaries sit in each item's folder."
    from types import SimpleNamespace

    from minivllm.config import ECTransferConfig
    from minivllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from minivllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

    item = tmp_path / "abc123"
    item.mkdir()
    stale, fresh = item / "tmpdead.tmp", item / "tmplive.tmp"
    stale.write_bytes(bytes(100))
    fresh.write_bytes(bytes(100))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # an hour old: its writer is gone
    ect = ECTransferConfig("ECExampleConnector", "ec_both", ec_connector_extra_config={"shared_storage_path": str(tmp_path)})
    ECExampleConnector(SimpleNamespace(ec_transfer_config=ect), ECConnectorRole.SCHEDULER)
    assert (stale.exists(), fresh.exists()) == (False, True)  # before: both stayed
