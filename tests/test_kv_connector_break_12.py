"""A twelfth try-to-break pass on the KV connectors and what they are combined with (issue 30).

1. Async scheduling: a request preempted while the step computing its last token was in flight was finished
   by that step's output but left in the waiting queue; the next `schedule()` admitted a freed request and
   the engine died (`KeyError` in `_update_after_schedule`). With any connector or none.
2. Two engines in one process, one with async scheduling, shared one module-global forward context (and
   KV / EC connector): each read the other's metadata and slots.
3. A P/D consumer of other weights (same shapes) accepted the producer's KV and cached it.
4. A producer restarted under a configured `engine_id` made each pull of old parameters wait 30 s.
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
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.lookup_client import (
    get_zmq_rpc_path_lmcache,
)
engine_id = str(uuid.uuid4())
kvt = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both", engine_id=engine_id,
                       kv_connector_extra_config={"chunk_size": 32, "local_cpu": True})
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, block_size=16, kv_transfer_config=kvt)
llm.generate([{"prompt_token_ids": list(range(3, 70))}], SamplingParams(max_tokens=2), use_tqdm=False)
print(get_zmq_rpc_path_lmcache(engine_id, 0).removeprefix("ipc://"), flush=True)
if sys.argv[2] == "collect":
    t = time.time()
    del llm
    gc.collect()
    print(f"collected in {time.time() - t:.1f}s", flush=True)
"""


@pytest.mark.parametrize("how", ["collect", "exit"])
def test_an_lmcache_engine_never_shut_down_neither_hangs_nor_leaves_its_socket(llama_dir, tmp_path, how):
    """5. An in-process LMCache engine dropped without `shutdown()`: `del llm; gc.collect()` never returned
    (3 of 3 runs: the lookup client's zmq context, collected in a reference cycle after its socket, waited
    for that socket in `term()`), and a program ending without `shutdown()` left its lookup socket file
    behind. Now the client's finalizer closes socket then context, and the server's runs at exit."""
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
