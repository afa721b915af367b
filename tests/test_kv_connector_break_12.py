"""A twelfth try-to-break pass on the KV connectors and what they are combined with (issue 30).

1. Async scheduling: a request preempted while the step computing its last token was in flight was finished
   by that step's output but left in the waiting queue; the next `schedule()` admitted a freed request and
   the engine died (`KeyError` in `_update_after_schedule`). With any connector or none.
2. Two engines in one process, one with async scheduling, shared one module-global forward context (and
   KV / EC connector): each read the other's metadata and slots.
3. A P/D consumer of other weights (same shapes) accepted the producer's KV and cached it.
4. A producer restarted under a configured `engine_id` made each pull of old parameters wait 30 s.
5. An in-process LMCache engine never shut down hung `gc.collect()` and left its lookup socket file.
6. A valid stored entry copied to another key (LMCache disk or Redis, ExampleConnector) was served.
7. A disk tier restarted over its cap stayed over it.
8. A slow tier grew the write-back queue without bound, and `close()` took 35 s.
9. A CPU graph captured in a step with fewer requests than its size replayed only those (wrong tokens).
10. A `kv_producer` pulled for a request that asked it to (`do_remote_prefill`).
11. A multiprocess `LLM` dropped without `shutdown()` kept its engine process until exit.
"""

import json
import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
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


def _pd_prefill(prod, prompt):
    extra = {"kv_transfer_params": {"do_remote_decode": True}}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, extra_args=extra)
    return prod.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].kv_transfer_params


def _decode(cons, prompt, kv_transfer_params=None, n=6):
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, extra_args=extra)
    return list(cons.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_consumer_of_other_weights_refuses_the_producers_kv(llama_dir, tmp_path, monkeypatch):
    """3. A consumer serving other weights of the same shapes pulled the producer's KV: wrong tokens, and its
    prefix cache then served them to a later request without any parameters. `prompt_digest` now names the
    weights (`weights_tag`): the pull is refused, the consumer recomputes, and both requests equal the
    consumer's model alone."""
    from test_kv_connector_break_10e import free_port  # tests/ is on sys.path

    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    other = make_tiny_checkpoint("llama", str(tmp_path / "other"), seed=1)  # same shapes, other weights
    kw = dict(dtype="float32", max_model_len=128, block_size=16)
    prompt = list(range(5, 42))
    alone = LLM(other, **kw)
    try:
        want = _decode(alone, prompt)
    finally:
        alone.llm_engine.shutdown()
    port = free_port()
    prod_kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port}
    cons_kvt = {
        "kv_connector": "P2pZmqConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"transfer_timeout_s": 10},
    }
    prod = LLM(llama_dir, **kw, kv_transfer_config=prod_kvt)
    cons = LLM(other, **kw, kv_transfer_config=cons_kvt)
    try:
        params = _pd_prefill(prod, prompt)
        assert _decode(cons, prompt, params) == want  # was: decoded from the producer's weights' KV
        assert _decode(cons, prompt) == want  # was: the poisoned prefix cache served it again
        worker = prod.llm_engine.engine_core.engine_core.model_executor.driver_worker
        stats = worker.model_runner.kv_connector.connector_worker._stats
        assert stats.get("p2p_prompt_mismatches", 0) >= 1
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_a_producer_restarted_under_a_configured_engine_id_refuses_old_parameters_at_once():
    """4. A producer restarted with the same configured `engine_id` answered RETRY to the old producer's
    parameters, so each such pull waited `transfer_timeout_s` (30.1 s) before recomputing; only the default
    uuid engine id was refused at once. The id in the parameters now carries the config's `instance_id`, new
    at each start (and the same in the scheduler and worker halves of one start)."""
    from types import SimpleNamespace

    from test_kv_connector_break_10e import free_port  # tests/ is on sys.path

    from minivllm.config import KVTransferConfig
    from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import P2pZmqConnector

    def start(port):
        kvt = KVTransferConfig(
            kv_connector="P2pZmqConnector", kv_role="kv_producer", kv_port=port, engine_id="prefill-0"
        )
        cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=4))
        scheduler_half = P2pZmqConnector(cfg, KVConnectorRole.SCHEDULER).connector_scheduler
        return scheduler_half.engine_id, P2pZmqConnector(cfg, KVConnectorRole.WORKER)

    port = free_port()
    old_id, before = start(port)
    assert old_id == before.connector_worker.engine_id and old_id.startswith("prefill-0.")
    before.shutdown()
    new_id, after = start(port)  # the same config, restarted on the same port
    try:
        assert new_id != old_id
        msg = {"req_id": "r", "tag": "t", "engine_id": old_id, "digest": "", "block_ids": [1]}
        reply = after.connector_worker._answer(b"READ", msg, b"conn")
        assert reply[0] == b"ERROR" and b"restarted" in reply[1], reply  # was RETRY: 30 s, then recompute
    finally:
        after.shutdown()


_DROPPED_ENGINE = """
import gc, os, sys, time, uuid
os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.lookup_client import (
    get_zmq_rpc_path_lmcache,
    lookup_engine_id,
)
engine_id = str(uuid.uuid4())
kvt = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both", engine_id=engine_id,
                       kv_connector_extra_config={"chunk_size": 32, "local_cpu": True})
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, block_size=16, kv_transfer_config=kvt)
llm.generate([{"prompt_token_ids": list(range(3, 70))}], SamplingParams(max_tokens=2), use_tqdm=False)
print(get_zmq_rpc_path_lmcache(lookup_engine_id(llm.llm_engine.vllm_config.kv_transfer_config), 0)
      .removeprefix("ipc://"), flush=True)
if sys.argv[2] == "collect":
    t = time.time()
    del llm
    gc.collect()
    print(f"collected in {time.time() - t:.1f}s", flush=True)
    import threading
    time.sleep(0.5)
    print("threads:", ",".join(t.name for t in threading.enumerate() if "lmcache" in t.name) or "none")
"""


@pytest.mark.parametrize("how", ["collect", pytest.param("exit", marks=pytest.mark.slow)])
def test_an_lmcache_engine_never_shut_down_neither_hangs_nor_leaves_its_socket(llama_dir, tmp_path, how):
    """5. An in-process LMCache engine dropped without `shutdown()`: `del llm; gc.collect()` never returned
    (3 of 3 runs: the lookup client's zmq context, collected in a reference cycle after its socket, waited
    for that socket in `term()`), and a program ending without `shutdown()` left its lookup socket file
    behind; once `gc` returned, its write-back and lookup threads, sockets and KV cache were still held (the
    process's current connector). Now the client's finalizer closes socket then context, the server's runs
    at exit, and a collected worker's runner shuts its connector down (`release_kv_transfer_group`)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "dropped.py"
    script.write_text(_DROPPED_ENGINE)
    run = subprocess.run(
        [sys.executable, str(script), llama_dir, how], capture_output=True, text=True, timeout=120
    )  # was: killed by the timeout (collect)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.split()
    assert not Path(lines[0]).exists(), "the lookup socket file was left behind"
    if how == "collect":
        assert "collected" in run.stdout
        assert "threads: none" in run.stdout, run.stdout  # the collected engine's connector stopped them


def _swap_in_new_files(folder, pattern, run_a, run_b):
    "Run a, then b (each returns once its entries are written); copy a's new files over b's: valid entries."
    run_a()
    files_a = set(folder.glob(pattern))
    run_b()
    files_b = set(folder.glob(pattern)) - files_a
    assert len(files_a) == len(files_b) > 0
    for file_a, file_b in zip(sorted(files_a), sorted(files_b)):
        file_b.write_bytes(file_a.read_bytes())
    return files_b


@pytest.mark.parametrize("connector", ["LMCacheConnectorV1", "ExampleConnector"])
def test_a_valid_entry_copied_to_another_key_is_a_miss(llama_dir, tmp_path, monkeypatch, connector):
    """6. A stored entry named no key: prompt A's valid chunk (or block file) copied over prompt B's was
    served as B's KV (LMCache disk: [43, 148, 35, 452, 280] against [437, 449, 382, 498, 449] alone; 1 hit, 0
    errors; ExampleConnector the same). The LMCache header names its key (`key_digest`; Redis values too),
    an ExampleConnector file its own file name: such an entry is a deleted miss, and B equals the engine
    alone."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = dict(dtype="float32", max_model_len=256, block_size=16, enable_prefix_caching=False)
    a, b = list(range(3, 43)), list(range(300, 340))  # one 32-token chunk (two blocks) each, and a tail
    if connector == "LMCacheConnectorV1":
        extra = {
            "chunk_size": 32,
            "local_cpu": False,
            "local_disk": str(tmp_path),
            "max_local_disk_size": 0.01,
        }
        pattern = "*.kvchunk"
    else:
        extra, pattern = {"shared_storage_path": str(tmp_path)}, "*.safetensors"
    kvt = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    alone = LLM(llama_dir, **kw)
    try:
        want = _decode(alone, b, n=5)
    finally:
        alone.llm_engine.shutdown()
    writer = LLM(llama_dir, **kw, kv_transfer_config=kvt)
    connector = get_kv_transfer_group_or_none()

    def store(prompt):
        _decode(writer, prompt[:32] + [7], n=1)
        if hasattr(connector, "storage"):  # LMCache writes the disk from a background thread
            connector.storage.flush()

    try:
        swapped = _swap_in_new_files(tmp_path, pattern, lambda: store(a), lambda: store(b))
    finally:
        writer.llm_engine.shutdown()
    reader = LLM(llama_dir, **kw, kv_transfer_config=kvt)
    try:
        assert _decode(reader, b, n=5) == want  # was: decoded from prompt A's KV
    finally:
        reader.llm_engine.shutdown()
    for f in swapped:  # deleted, then stored again by the recompute
        if f.suffix == ".kvchunk":
            header_len = int.from_bytes(f.read_bytes()[6:10], "little")
            assert json.loads(f.read_bytes()[10 : 10 + header_len])["key"] == f.stem  # it names its own key


def test_a_redis_value_set_at_another_key_is_a_deleted_miss():
    """6. The Redis tier: a valid chunk copied to another chunk's key is a deleted miss."""
    import shutil
    import subprocess
    import time

    import torch

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; CI installs it)")
    from test_kv_connector_break_10e import free_port  # tests/ is on sys.path

    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
        RemoteBackend,
    )
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import CacheEngineKey

    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        probe = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        for _ in range(200):  # up before the tier connects (a refused connection would count as an error)
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        probe.close()
        remote = RemoteBackend(f"redis://127.0.0.1:{port}", timeout_s=2.0)
        key_a, key_b = (CacheEngineKey("m#1", 1, 0, h * 32, "float32") for h in ("ab", "cd"))
        kv = torch.randn(2, 2, 16, 2, 8)
        assert remote.put(key_a, kv) and torch.equal(remote.get(key_a), kv)
        remote._client.set(remote._name(key_b), remote._client.get(remote._name(key_a)))  # copied
        errors = remote.num_errors
        assert remote.get(key_b) is None and remote.num_errors == errors + 1  # was: a's KV served at b
        assert not remote._client.exists(remote._name(key_b))
        remote.close()
    finally:
        server.terminate()
        server.wait(timeout=10)


def _chunk_key(i: int):
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import CacheEngineKey

    return CacheEngineKey("tiny#1", 1, 0, f"{i:064x}", "float32")


def test_a_disk_tier_started_over_its_cap_evicts_down_to_it(tmp_path):
    """7. A disk tier restarted on a folder over its (lower) cap stayed there: 396,480 bytes against a cap of
    49,560 (8x), 0 evictions, since only `put` evicted and an engine that only reads never put. It evicts
    down to the cap at start now, oldest first."""
    import torch

    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
        LocalDiskBackend,
    )

    first = LocalDiskBackend(tmp_path, 1 << 30)
    for i in range(24):
        assert first.put(_chunk_key(i), torch.full((2, 2, 16, 2, 8), float(i)))
    one = first.used_bytes // 24
    restarted = LocalDiskBackend(tmp_path, 3 * one)
    assert restarted.used_bytes <= 3 * one and restarted.num_evictions == 21  # was: 24 files, 0 evictions
    assert len(list(tmp_path.glob("*.kvchunk"))) == 3


def test_a_slow_tier_bounds_the_write_back_queue_and_close():
    """8. A slow tier that never fails: the write-back queue (a copy of every chunk until written) grew with
    traffic, 47 -> 113 queued writes in six rounds, and `close()` took 35.0 s (a 30 s flush, a 5 s join) while
    the writer went on writing after it returned. Queued bytes are bounded now (`max_pending_bytes`: saves
    past it are dropped and counted) and `close` waits at most its timeout."""
    import threading
    import time

    import torch

    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
        StorageManager,
    )
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import LMCacheEngineConfig

    writes = []

    class SlowTier:
        name, num_errors = "SlowTier", 0

        def put(self, key, kv):
            time.sleep(0.3)
            writes.append(threading.get_ident())
            return True

    store = StorageManager(LMCacheEngineConfig(chunk_size=16, local_cpu=False))
    store.tiers = [SlowTier()]
    kv = torch.zeros(2, 2, 16, 2, 8)
    store.max_pending_bytes = 4 * kv.numel() * kv.element_size()
    for i in range(40):
        store.put(_chunk_key(i), kv)
    assert store.pending_bytes <= store.max_pending_bytes and store.stats()["dropped_writes"] >= 36
    started = time.monotonic()
    store.close(timeout_s=0.5)
    took = time.monotonic() - started
    written = len(writes)
    time.sleep(0.7)
    assert took < 2.0, took  # was: 35 s with a 0.3 s tier
    assert len(writes) == written  # nothing written after close returned
    assert store.pending_bytes == 0 and not store._pending


def test_a_cpu_graph_captured_with_fewer_requests_than_its_size_serves_a_full_batch(llama_dir, monkeypatch):
    """9. A CPU graph is captured in the first step of its size. Its attention metadata described the real
    requests, so a size-4 graph captured while 3 requests decoded recorded a kernel over 3 requests and a
    key/value write of 3 slots; once 4 requests decoded, every replay left the fourth's attention and KV
    unwritten (found with preemption and prefix caching: the logprob of the next token went from -4.30 to
    another token at -4.27). The metadata of a FULL step now describes the padded size: each request
    equals itself alone."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = dict(dtype="float32", max_model_len=256, block_size=16)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (21, 30, 17, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(llama_dir, **kw, enforce_eager=True)
    try:
        want = [_greedy(alone, [p], [12])[0] for p in prompts]
    finally:
        alone.llm_engine.shutdown()
    llm = LLM(llama_dir, **kw)  # CPU graphs for decode steps (FULL_DECODE_ONLY), captured as sizes come
    try:
        engine = llm.llm_engine
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        done: dict[str, list[int]] = {}
        for step in range(200):
            if step == 4:  # the three decode (size 4 is captured with 3 requests); then a fourth joins
                engine.add_request("r3", {"prompt_token_ids": prompts[3]}, params)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            if len(done) == 4:
                break
        runner = engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        assert any(d.num_tokens == 4 for d in runner.cudagraphs)  # the graph of this test was used
        assert [done.get(f"r{i}") for i in range(4)] == want  # was: r3 wrong from its first replayed step
    finally:
        llm.llm_engine.shutdown()


def test_a_kv_producer_computes_a_request_that_asks_it_to_pull():
    """10. A `kv_producer` given `do_remote_prefill` pulled like a consumer (6 of 42 tokens scheduled), from
    whatever host:port the client named, and cached what it got. Now it computes the request itself (the
    mirror of a consumer ignoring `do_remote_decode`); a kv_both engine still pulls."""
    from types import SimpleNamespace

    from minivllm.config import KVTransferConfig
    from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import P2pZmqConnector

    def asks_to_pull():
        params = {"do_remote_prefill": True, "remote_block_ids": [0, 1], "remote_request_id": "r",
                  "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 40000}  # fmt: skip
        return SimpleNamespace(request_id="q", kv_transfer_params=params, num_prompt_tokens=37, num_tokens=37)

    got = {}
    for role in ("kv_producer", "kv_both"):
        kvt = KVTransferConfig(kv_connector="P2pZmqConnector", kv_role=role)
        cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=16))
        scheduler_half = P2pZmqConnector(cfg, KVConnectorRole.SCHEDULER)
        request = asks_to_pull()
        got[role] = (scheduler_half.get_num_new_matched_tokens(request, 0), request.kv_transfer_params)
    assert got["kv_producer"][0] == (0, False)  # was: (n, True), a pull
    assert got["kv_producer"][1]["do_remote_prefill"] is False
    assert got["kv_both"][0][1] is True  # pulls asynchronously


def test_each_engine_start_from_one_config_object_gets_its_own_instance_id():
    """4b. One `KVTransferConfig` object reused for a restart in the same process kept its `instance_id`, so
    the old producer's parameters waited `transfer_timeout_s` again (8.57 s of 8). Each engine config now
    copies it: a fresh `instance_id`, the same `engine_id`."""
    from minivllm.config import KVTransferConfig
    from minivllm.engine.arg_utils import EngineArgs

    kvt = KVTransferConfig(kv_connector="P2pZmqConnector", kv_role="kv_producer", engine_id="prefill-0")
    args = EngineArgs(model="m", kv_transfer_config=kvt)
    first, second = args.create_kv_transfer_config(), args.create_kv_transfer_config()
    assert first.engine_id == second.engine_id == "prefill-0"
    assert first.instance_id != second.instance_id  # was: both kvt.instance_id


_DROPPED_MP_ENGINE = """
import gc, os, sys, time
os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the default, whatever the test run sets
from minivllm import LLM, SamplingParams
def children():
    me, out = os.getpid(), []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(p)
    return out
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, block_size=16)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=2), use_tqdm=False)
    print("children while alive:", len(children()), flush=True)
    del llm
    gc.collect()
    deadline = time.time() + 15
    while children() and time.time() < deadline:
        time.sleep(0.2)
    print("children after drop:", len(children()), flush=True)
"""


def test_a_multiprocess_llm_dropped_without_shutdown_stops_its_engine_process(llama_dir, tmp_path):
    """11. An `LLM` (engine core in its own process, the default) dropped without `shutdown()` was never
    collected: its output thread's target was a bound method of the client, so the client's finalizer never
    ran and the engine process lived on (4 dropped engines: 4 processes, 1.37 GB each; a producer's
    `kv_port` still taken). The thread now holds the client weakly: the process is stopped."""
    import subprocess
    import sys

    script = tmp_path / "dropped_mp.py"
    script.write_text(_DROPPED_MP_ENGINE)
    command = [sys.executable, str(script), llama_dir]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "children while alive: 1" in run.stdout, run.stdout
    assert "children after drop: 0" in run.stdout, run.stdout  # was: 1, until the interpreter exits
