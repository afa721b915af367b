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
