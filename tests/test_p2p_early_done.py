"""A release that overtakes the producer's registration (chapter 47e `_note_early_done`): the CI failure of
`tests/test_disagg_proxy_leave.py::test_a_burst_of_departing_clients_leaves_no_producer_block_held` (2 blocks
held, and 6 in 1 of 3 runs here).

A producer's engine finishes a `do_remote_decode` request and its parameters leave with the output at once,
but its worker learns of the held blocks only from the next step's connector metadata. The proxy releases
a departed client's parameters within milliseconds (`release_remote_blocks`): that `DONE` came between the
two, was ACKed for nothing held, and the blocks stayed held for `abort_timeout_s` (120 s). Now the worker
remembers it and frees the request when it is registered. Tiny random llama, float32, in this process.
"""

import socket

import pytest

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import release_remote_blocks
from minivllm.testing import make_tiny_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": _free_port(),
           "kv_connector_extra_config": {"abort_timeout_s": 120}}  # fmt: skip
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)
    yield llm
    llm.llm_engine.shutdown()


def _held(llm) -> int:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is the null block


def _prefill_without_the_next_step(llm, rid: str, prompt: list[int]) -> dict:
    "Step the engine until `rid` finishes; returns its kv_transfer_params (the worker not told yet)."
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    engine = llm.llm_engine
    engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                return out.kv_transfer_params
    raise AssertionError("the prefill never finished")


def _steps_until_free(llm, steps: int = 10) -> int:
    "Step the idle engine (as its busy loop does while blocks are held); returns the blocks still held."
    for _ in range(steps):
        llm.llm_engine.step()
        if _held(llm) == 0:
            return 0
    return _held(llm)


def test_a_release_before_the_next_step_frees_the_blocks(producer):
    "Before: ACKed, and the 3 blocks were held after 10 more steps (until abort_timeout_s). Now: freed."
    params = _prefill_without_the_next_step(producer, "early", list(range(5, 45)))
    worker = producer.llm_engine.engine_core.engine_core.model_executor.driver_worker
    assert params["remote_request_id"] not in worker.model_runner.kv_connector.connector_worker._to_send
    assert _held(producer) == 3
    assert release_remote_blocks(params, timeout_s=5) == 1
    assert _steps_until_free(producer) == 0


def test_a_forged_release_first_does_not_keep_the_real_one_from_freeing(producer):
    """Another prompt's digest first (a guess at the id): it frees nothing, and the proxy's real release
    after it still frees the blocks at registration."""
    params = _prefill_without_the_next_step(producer, "forged-first", list(range(100, 140)))
    assert release_remote_blocks(dict(params, prompt_digest="0" * 64), timeout_s=5) == 1
    assert release_remote_blocks(params, timeout_s=5) == 1
    assert _steps_until_free(producer) == 0


def test_only_a_forged_release_frees_nothing(producer):
    "A DONE with another prompt's digest alone: the blocks stay held for their consumer."
    params = _prefill_without_the_next_step(producer, "forged", list(range(200, 240)))
    assert release_remote_blocks(dict(params, prompt_digest="0" * 64), timeout_s=5) == 1
    assert _steps_until_free(producer, steps=5) == 3
    assert release_remote_blocks(params, timeout_s=5) == 1  # the real one, now that it is registered
    assert _steps_until_free(producer) == 0


def _flood(params: dict, n: int, id_chars: int = 40) -> None:
    "n DONEs for ids the producer never ran (random, `id_chars` long), each with a well-shaped digest."
    import json
    import secrets

    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{params['remote_port']}")
    try:
        for _ in range(n):
            body = {"req_id": secrets.token_hex(id_chars // 2), "tag": "x", "digest": "0" * 64}
            sock.send_multipart([b"DONE", json.dumps(body).encode()])
        for _ in range(n):
            assert sock.poll(10_000), "the producer stopped answering"
            assert sock.recv_multipart()[0] == b"ACK"
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_flood_of_forged_dones_stores_nothing_and_keeps_the_real_one(producer):
    """Break pass 15A: any DONE for an unknown id was remembered (1024 ids, 4 digests each, any length):
    300 forged DONEs with 0.8 MB ids held 491 MB, and 1100 of them after the proxy's real release pushed it
    out (3 blocks held for abort_timeout_s). Now only a request the engine runs is remembered."""
    params = _prefill_without_the_next_step(producer, "flooded", list(range(300, 340)))
    assert release_remote_blocks(params, timeout_s=5) == 1  # the real release, early
    _flood(params, 1100)
    _flood(params, 20, id_chars=100_000)
    worker = producer.llm_engine.engine_core.engine_core.model_executor.driver_worker
    early = worker.model_runner.kv_connector.connector_worker._early_done
    assert set(early) == {params["remote_request_id"]}, len(early)
    assert _steps_until_free(producer) == 0
