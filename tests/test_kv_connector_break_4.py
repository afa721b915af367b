"""A fifth try-to-break pass on the KV and EC connectors (issue 30): aborts, async scheduling, planted files.

1. A request aborted while the step that loads its blocks runs: one block's load failed, but the abort freed
   the request before the step's output came back, so no request held the block when its failure was
   handled, and it stayed in the prefix cache under the hash of KV it never received. The next request with
   that prompt attended to it and gave other tokens, silently (ExampleConnector and LMCache alike). Every
   block reported invalid now leaves the prefix cache, whoever holds it.
2. `async_scheduling=True` with a failed load: the request was rolled back, but the placeholder of the token
   its step sampled (and of the next step, already scheduled) stayed, so the scheduler asked for tokens that
   would never come and the engine never finished the request (a hang; vLLM had the same fault, its PR
   45430). Placeholders start over, and a token sampled by a step in flight on the failed context is dropped.
3. A planted file whose valid safetensors header declares a tensor of 1.5 GiB (a sparse file costs no disk):
   ExampleConnector and ECExampleConnector read it whole, then checksummed it, then refused it (the engine's
   memory grew by 1.5 GiB per load). The header's layers and shapes are now checked before any tensor is
   read.
4. A P2P producer whose port is taken failed with ZeroMQ's bare "Address already in use (addr=...:p+1)": under
   data parallelism (or tensor parallelism) that is a port the user never typed (engine i serves on kv_port +
   i x tensor_parallel_size). The error now names `kv_port` and how each rank's port is derived.
5. A P2P producer restarted (same port) between handing out `kv_transfer_params` and the consumer's pull:
   the new one did not know the request and answered RETRY until the consumer's `transfer_timeout_s` (30 s by
   default) ran out, for every such request. A READ now carries the `remote_engine_id` it was given, and a
   producer of another engine id refuses it at once (the consumer recomputes).
"""

import os
import socket
import subprocess
import sys
import time

import pytest
from test_kv_connector_break_2 import _store_one_damaged_block  # tests/ is on sys.path

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port

KW = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20)
FIRST = list(range(5, 5 + 20))  # one full block stored
PROMPTS = [FIRST, FIRST[:16] + list(range(400, 440)), list(range(300, 300 + 37))]
CONNECTORS = ["ExampleConnector", "LMCacheConnectorV1"]


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


def _sp():
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _greedy(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _sp(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts, timeout: float = 60.0) -> list[list[int]]:
    "Greedy tokens of `prompts`, stepping by hand: fails (never hangs) if they are not done in `timeout` s."
    ids = [llm.llm_engine.add_request(f"r{i}", {"prompt_token_ids": p}, _sp()) for i, p in enumerate(prompts)]
    done, t0 = {}, time.monotonic()
    while len(done) < len(ids):
        assert time.monotonic() - t0 < timeout, f"{len(ids) - len(done)} request(s) never finished"
        done.update({o.request_id: o.outputs[0].token_ids for o in llm.llm_engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(prompts))]


# ---- 1. an abort in the step of a failed load ----


@pytest.mark.parametrize("connector", CONNECTORS)
def test_an_abort_during_a_failed_load_leaves_no_bad_block_cached(llama, tmp_path, connector):
    path, expected = llama
    kw = dict(KW, enable_prefix_caching=True)
    kvt = _store_one_damaged_block(path, kw, connector, tmp_path, FIRST)
    llm = LLM(path, **kw, kv_transfer_config=kvt)
    try:
        core = llm.llm_engine.engine_core.engine_core
        pool = core.scheduler.kv_cache_manager.block_pool
        all_free = pool.get_num_free_blocks()
        execute, calls = core.model_executor.execute_model, []

        def abort_while_it_runs(*args, **kwargs):  # the client's abort arrives while the loading step runs
            out = execute(*args, **kwargs)
            if not calls:
                llm.llm_engine.abort_request(["victim"])
            calls.append(1)
            return out

        core.model_executor.execute_model = abort_while_it_runs
        llm.llm_engine.add_request("victim", {"prompt_token_ids": FIRST}, _sp())
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
        core.model_executor.execute_model = execute
        assert pool.get_num_free_blocks() == all_free
        assert _run(llm, PROMPTS[:1]) == expected[:1]  # before: the failed block was a prefix-cache hit
    finally:
        llm.llm_engine.shutdown()


# ---- 2. async scheduling and a failed load ----


@pytest.mark.parametrize("connector", CONNECTORS)
def test_async_scheduling_recovers_from_a_failed_load(llama, tmp_path, connector):
    path, expected = llama
    kvt = _store_one_damaged_block(path, KW, connector, tmp_path, FIRST)
    for _ in range(2):  # the damaged load (recomputed), then a run that loads what the first one stored
        llm = LLM(path, **KW, async_scheduling=True, kv_transfer_config=kvt)
        try:
            pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            all_free = pool.get_num_free_blocks()
            assert _run(llm, PROMPTS) == expected  # before: the rolled-back requests never finished
            assert pool.get_num_free_blocks() == all_free
        finally:
            llm.llm_engine.shutdown()


# ---- 3. a planted file that declares a gigabyte ----

_PROBE = r"""
import json, resource, sys, tempfile
from types import SimpleNamespace
import torch

which, gib = sys.argv[1], float(sys.argv[2])


def plant(path, names):
    "A valid safetensors header, the first tensor `gib` GiB of float32 (sparse: no disk), the others tiny."
    header, off = {}, 0
    for i, name in enumerate(names):
        shape = [int(gib * (1 << 30) / 32), 8] if i == 0 else [1]
        n = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"sha256": "0" * 64}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + off)


folder = tempfile.mkdtemp()
if which == "kv":
    from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector, ExampleConnectorMetadata)
    extra = {"shared_storage_path": folder}
    kvt = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_extra_config=extra)
    cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=4),
                          model_config=SimpleNamespace(model="toy", dtype=torch.float32))
    conn = ExampleConnector(cfg, KVConnectorRole.WORKER)
    conn.register_kv_caches({f"layers.{i}.attn": torch.zeros(2, 8, 4, 1, 2) for i in range(2)})
    plant(conn._path("ab" * 32), ["layers.0.attn", "layers.1.attn"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    conn.bind_connector_metadata(ExampleConnectorMetadata(loads=[("ab" * 32, 3)]))
    conn.start_load_kv(None)
    assert conn.get_block_ids_with_load_errors() == {3}
else:
    from minivllm.config import ECTransferConfig
    from minivllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from minivllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnector, ECExampleConnectorMetadata, MMMeta)
    extra = {"shared_storage_path": folder}
    ect = ECTransferConfig("ECExampleConnector", "ec_consumer", ec_connector_extra_config=extra)
    cfg = SimpleNamespace(ec_transfer_config=ect, device_config=SimpleNamespace(device="cpu"),
                          model_config=SimpleNamespace(dtype=torch.float32))
    conn = ECExampleConnector(cfg, ECConnectorRole.WORKER)
    path = conn._generate_filename_debug("img1")
    path.parent.mkdir(parents=True)
    plant(path, ["ec_cache"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    conn.bind_connector_metadata(ECExampleConnectorMetadata([MMMeta("img1", 3)]))
    cache = {}
    conn.start_load_caches(cache)
    assert cache == {}
print("GROWTH_MIB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""


@pytest.mark.parametrize("which", ["kv", "ec"])
def test_a_planted_gigabyte_header_is_refused_unread(which):
    "In a fresh process (its peak memory is its own): the load is refused and memory grows by far less."
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PROBE, which, "1.5"], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    growth = int(out.stdout.split("GROWTH_MIB")[1])
    assert growth < 256, f"peak memory grew by {growth} MiB"  # before: 1538 MiB


# ---- 4. a P2P producer's port taken: the error names kv_port ----


def test_a_taken_p2p_port_names_kv_port(llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port}
        with pytest.raises(RuntimeError, match="Address already in use") as e:  # before: a bare ZMQError
            LLM(llama[0], **KW, kv_transfer_config=kvt)
    assert "kv_port" in str(e.value) and "tensor_parallel_size" in str(e.value)


# ---- 5. a restarted P2P producer refuses what it never held, at once ----


def test_a_restarted_producer_refuses_old_pulls_at_once(llama):
    path, expected = llama
    producer = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": get_open_port()}
    prod = LLM(path, **KW, kv_transfer_config=producer)
    remote = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    params = prod.generate([{"prompt_token_ids": PROMPTS[2]}], remote, use_tqdm=False)[0].kv_transfer_params
    prod.llm_engine.shutdown()
    prod = LLM(path, **KW, kv_transfer_config=producer)  # restarted on the same port: a new engine id
    consumer = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"transfer_timeout_s": 600}}  # fmt: skip
    cons = LLM(path, **KW, kv_transfer_config=consumer)
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            extra_args={"kv_transfer_params": params})  # fmt: skip
        cons.llm_engine.add_request("r0", {"prompt_token_ids": PROMPTS[2]}, sp)
        done, t0 = [], time.monotonic()
        while not done:  # before: RETRY for transfer_timeout_s (600 s here)
            assert time.monotonic() - t0 < 60, "the pull from the restarted producer did not fail at once"
            done = [o for o in cons.llm_engine.step() if o.finished]
        assert done[0].outputs[0].token_ids == expected[2]  # computed by the consumer
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()
