"""A fifth try-to-break pass on the KV connectors (issue 30), aimed at the fourth pass's fixes.

1. P2P consumer: `kv_transfer_params` come from a client, and the `tp_size` check accepted any size up to
   4096. A forged `"tp_size": 4096` made the consumer say DONE to 4096 "ranks" at once: 341 peers (1,023
   ZeroMQ sockets, the context's limit) opened in one go, so every other pull of that engine failed with
   "Too many open files" and was recomputed until those peers closed (up to `transfer_timeout_s` when the
   ports accept and stay silent). A size beyond any real producer's, or one whose ranks' ports run past
   65535, is malformed: the request is computed locally and nothing is opened.
"""

import pytest
from test_kv_connector_pd import _count_scheduled, _decode_params, _llm, _prefill, _run_until, free_port

from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
from minivllm.testing import make_tiny_checkpoint

PROMPT = list(range(5, 5 + 37))
MAX_TOKENS = 6  # what _decode_params asks for


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


# ---- 1. a forged tp_size must not open thousands of peers ----


@pytest.mark.parametrize("tp_size", [4096, 2])
def test_a_forged_tp_size_does_not_starve_other_pulls(ckpt, tp_size):
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 20}})  # fmt: skip
    worker = get_kv_transfer_group_or_none().connector_worker
    try:
        params = _prefill(prod, PROMPT).kv_transfer_params
        counts = _count_scheduled(cons)
        bad_port = 65535 if tp_size == 2 else free_port()  # tp_size 2 at 65535: rank 1's port is no port
        forged = dict(params, remote_request_id="forged", remote_port=bad_port, tp_size=tp_size)
        finished = {}
        other = {"prompt_token_ids": list(range(300, 320))}
        cons.llm_engine.add_request("forged", other, _decode_params(forged))
        cons.llm_engine.add_request("good", {"prompt_token_ids": PROMPT}, _decode_params(params))
        _run_until(cons, "good", finished)
        _run_until(cons, "forged", finished)
        assert len(finished["forged"].outputs[0].token_ids) == MAX_TOKENS
        # before (4096): the good pull failed and its 37 tokens were computed too
        assert sum(counts) == 20 + 1 + 2 * (MAX_TOKENS - 1)
        assert len(worker._peers) <= 2  # before: 341 peers opened for one request
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()
