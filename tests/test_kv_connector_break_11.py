"""An eleventh try-to-break pass on the KV connectors (issue 30: nothing is served from a freed block; a
fault fails fast or recovers, never hangs; a peer or tier is untrusted).

1. The P2P producer copied a held request's blocks after letting go of its lock: a DONE from another
   connection (or the request's deadline) could free them between the last check and the copy, and the
   scheduler hand them to a new request whose forward writes into them while their bytes were being sent.
   The copy now runs under the lock, after one more check that the request is still held.
2. A streamed request with `do_remote_decode` made the producer hold blocks no chunk names.
3. `remote_block_ids` reordered or shifted by a client poisoned the consumer's prefix cache.
4. A peer flooding answers held the consumer's pull thread (every pull, every deadline) for its flood.
"""

import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from test_kv_connector_break_10e import free_port  # tests/ is on sys.path

from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import P2pZmqConnector


def test_a_request_freed_between_the_checks_and_the_copy_is_not_served():
    kvt = KVTransferConfig(kv_connector="P2pZmqConnector", kv_role="kv_producer", kv_port=free_port())
    cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=4))
    prod = P2pZmqConnector(cfg, KVConnectorRole.WORKER)
    w = prod.connector_worker
    try:
        w.register_kv_caches({f"l{i}": torch.randn(2, 8, 4, 1, 2) for i in range(2)})
        with w._lock:
            w._to_send["r"] = ([3, 5], time.time() + 60, "")
        checked = w._refuse_reader

        def then_done_elsewhere(rid, ident):  # another connection's DONE lands right after this READ's checks
            why = checked(rid, ident)
            with w._lock:
                w._release(rid)
            return why

        w._refuse_reader = then_done_elsewhere
        msg = {"req_id": "r", "tag": "t", "digest": "", "block_ids": [3, 5]}
        reply = w._answer(b"READ", msg, b"conn-1")
        assert reply[0] == b"ERROR" and b"released" in reply[1], reply[:2]  # was OK: bytes of freed blocks
        assert len(reply) == 2  # no data frames
        sending, _ = w.get_finished()
        assert sending == {"r"}
    finally:
        prod.shutdown()


def test_a_streamed_request_asking_for_remote_decode_holds_no_producer_blocks(tmp_path_factory, monkeypatch):
    """2. A streamed request with `do_remote_decode` made the producer hold its blocks for `abort_timeout_s`
    (120 s), though no chunk names them: nobody could ever pull them (4 streams held 24 of 127 blocks). Now it
    is served without remote decode, as a request with n > 1 is."""
    import httpx
    from test_server import API_KEY, Server  # tests/ is on sys.path

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.testing import make_tiny_checkpoint
    from minivllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": free_port()}
    args = EngineArgs(model=path, dtype="float32", max_model_len=128, block_size=16,
                      kv_cache_memory_bytes=1 << 20, kv_transfer_config=kvt)  # fmt: skip
    prod = Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        scheduler = prod.engine.engine_core.scheduler
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        remote = {"do_remote_decode": True}
        bodies = {
            "/v1/completions": {"prompt": list(range(5, 75))},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello " * 30}]},
        }
        for route, body in bodies.items():
            body = dict(body, model="tiny", max_tokens=1, stream=True, kv_transfer_params=remote)
            with httpx.stream("POST", prod.url + route, json=body, headers=headers, timeout=60) as r:
                text = "".join(r.iter_text())
            assert r.status_code == 200 and "[DONE]" in text, text[-300:]
        prod.wait_idle()
        assert scheduler.delayed_free_req_ids == set()  # was: both requests' blocks held for 120 s
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
        body = {"model": "tiny", "prompt": list(range(5, 75)), "max_tokens": 1, "kv_transfer_params": remote}
        r = httpx.post(prod.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.json()["kv_transfer_params"]["remote_block_ids"]  # a non-streamed one is still held
    finally:
        prod.stop()


def _llm(ckpt, kvt=None):
    from minivllm import LLM

    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)


def _greedy(llm, prompt, params=None, max_tokens=6):
    from minivllm import SamplingParams

    extra = {"kv_transfer_params": dict(params)} if params else None
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    return list(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)


def test_the_producers_own_blocks_reordered_or_shifted_are_refused(tmp_path, monkeypatch):
    """3. The producer served any subset of a held request's blocks in any order, and the consumer writes
    the i-th block it gets into its i-th reserved one: `remote_block_ids` reversed or shifted by a client put
    right bytes in wrong places. The output was garbage, and that KV stayed in the consumer's prefix cache
    under the prompt's hashes for every later request, `allowed_producers` or not. The producer now serves
    only its blocks from the position the READ names, in order; anything else recomputes."""
    from minivllm import SamplingParams
    from minivllm.testing import make_tiny_checkpoint

    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ckpt = make_tiny_checkpoint("llama", tmp_path / "llama")
    prompt = list(range(5, 5 + 49))  # 3 full blocks of 16 and one token
    ref = _llm(ckpt)
    want = _greedy(ref, prompt)
    ref.llm_engine.shutdown()
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    extra = {"transfer_timeout_s": 20, "allowed_producers": [f"127.0.0.1:{port}"]}
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": extra})  # fmt: skip
    try:
        for forge in (lambda ids: ids[::-1], lambda ids: ids[1:], lambda ids: ids):
            sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            params = prod.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].kv_transfer_params
            forged = dict(params, remote_block_ids=forge(params["remote_block_ids"]))
            assert _greedy(cons, prompt, forged) == want, forged["remote_block_ids"]
            assert _greedy(cons, prompt) == want  # what the consumer's prefix cache now holds for the prompt
            cons.reset_prefix_cache()
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


_FLOODER = """
import json, sys, time
import zmq
router = zmq.Context().socket(zmq.ROUTER)
router.setsockopt(zmq.SNDHWM, 0)
router.bind(f"tcp://127.0.0.1:{sys.argv[1]}")
print("bound", flush=True)
ident = router.recv_multipart()[0]
head = json.dumps({"tag": "nobody", "pad": [0] * 20000}).encode()
end = time.monotonic() + 20
while time.monotonic() < end:  # answers to nobody, as fast as it can
    router.send_multipart([ident, b"RETRY", head])
"""


def test_a_peer_flooding_answers_delays_no_other_pull_nor_its_own_deadline():
    """4. A peer that answered a READ with a stream of answers whose tags name no pull held the consumer's
    pull thread for as long as it streamed (113,104 answers in 40 s): a pull to a refused port, normally
    failed in milliseconds, and the flooded pull's own 3 s deadline were handled only after the flood. A
    producer answers each message once; more answers than messages now fail that peer at once."""
    from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import (
        P2pZmqConnectorMetadata,
        RecvReqMeta,
    )

    fport, dead = free_port(), free_port()
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, str(fport)], stdout=subprocess.PIPE)
    assert flooder.stdout.readline() == b"bound\n"
    kvt = KVTransferConfig(kv_connector="P2pZmqConnector", kv_role="kv_consumer",
                           kv_connector_extra_config={"transfer_timeout_s": 3})  # fmt: skip
    cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=4))
    w = P2pZmqConnector(cfg, KVConnectorRole.WORKER).connector_worker
    w.register_kv_caches({f"l{i}": torch.zeros(2, 8, 4, 1, 2) for i in range(2)})
    try:
        t0 = time.monotonic()
        flooded = RecvReqMeta([1, 2], [1, 2], "x", "e", "127.0.0.1", fport)
        w.start_load_kv(P2pZmqConnectorMetadata(reqs_to_recv={"A": flooded}))
        time.sleep(0.5)
        refused = RecvReqMeta([3, 4], [1, 2], "y", "e", "127.0.0.1", dead)
        w.start_load_kv(P2pZmqConnectorMetadata(reqs_to_recv={"B": refused}))
        done: dict[str, float] = {}
        while len(done) < 2 and time.monotonic() - t0 < 30:
            for r in w.get_finished()[1] or ():
                done[r] = time.monotonic() - t0
            time.sleep(0.02)
        assert set(done) == {"A", "B"} and max(done.values()) < 4, done  # were both at the flood's end
        assert w.get_block_ids_with_load_errors() == {1, 2, 3, 4}  # both recompute
        assert w.get_kv_connector_stats()["p2p_bad_answers"] == 1
    finally:
        flooder.kill()
        flooder.wait()
        w.shutdown()
