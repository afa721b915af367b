"""An eleventh try-to-break pass on the KV connectors (issue 30: nothing is served from a freed block; a
fault fails fast or recovers, never hangs; a peer or tier is untrusted).

1. The P2P producer copied a held request's blocks after letting go of its lock: a DONE from another
   connection (or the request's deadline) could free them between the last check and the copy, and the
   scheduler hand them to a new request whose forward writes into them while their bytes were being sent.
   The copy now runs under the lock, after one more check that the request is still held.
"""

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
