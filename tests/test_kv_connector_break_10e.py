"""A tenth try-to-break pass on P2pZmqConnector (issue 30: a fault fails fast or recovers, never hangs;
nothing is held forever; a peer is untrusted), end to end with a real producer and consumer in this process.

1. Replaying `kv_transfer_params` that were already pulled stalled the request for `transfer_timeout_s`
   (30 s): the producer answered RETRY both for "not registered yet" and for "already released". It now
   remembers the ids it freed (the last `_MAX_RELEASED`) and refuses a READ of one with ERROR at once: the
   consumer recomputes.
2. The children of an n > 1 request (the front end fans a parent into n engine requests with the same
   `kv_transfer_params`) each pulled the same producer request; the first child's DONE freed it and the
   others got RETRY until the timeout (30 s). The consumer's worker now joins a pull of a producer request
   that is already being read (same producer, request, engine and prompt digest): one READ fills every
   sibling's blocks and the producer hears DONE once, when the last of them is done. (`Request` keeps its
   own copy of `kv_transfer_params`, so that in process the children are as separate as over the
   engine-core socket, where each already had its own.)
3. A consumer request that finished (aborted) before its pull started never told the producer DONE: the
   producer held the blocks until `abort_timeout_s` (120 s). `request_finished` now queues a pull with no
   local blocks for it, as vLLM's NIXL connector does, and the worker only says DONE.
4. Unread READs made the producer queue up to ~1000 copies of a request's KV per connection (250 MB for 32
   blocks of the tiny model, GBs with a real one). A held request is now served once per connection and to
   at most `_MAX_READERS` connections; a READ beyond that is a small ERROR.
"""

import json
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
from test_kv_connector_pd import _count_scheduled  # the same counter (tests/ is on sys.path)

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import _MAX_READERS, P2pZmqConnector
from minivllm.testing import make_tiny_checkpoint

PROMPT = list(range(5, 5 + 37))  # three blocks of 16
MAX_TOKENS = 4


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llm(ckpt, kvt=None):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)


def _pair(ckpt, transfer_timeout_s=60):
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port,
                       "kv_connector_extra_config": {"abort_timeout_s": 120}})  # fmt: skip
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": transfer_timeout_s}})  # fmt: skip
    return prod, cons


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _free_blocks(llm) -> int:
    return _scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def _prefill(prod, prompt=PROMPT) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    return prod.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].kv_transfer_params


def _decode(cons, params, n=1):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n,
                        extra_args={"kv_transfer_params": dict(params)})  # fmt: skip
    return [o.token_ids for o in cons.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs]


def _reference(ckpt, n=1):
    ref = _llm(ckpt)
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
        return [
            o.token_ids for o in ref.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs
        ]
    finally:
        ref.llm_engine.shutdown()


def _wait_all_free(prod, all_free, timeout=10) -> bool:
    deadline = time.monotonic() + timeout
    while _free_blocks(prod) < all_free and time.monotonic() < deadline:
        prod.llm_engine.step()  # finished_sending reaches the producer's scheduler
        time.sleep(0.01)
    return _free_blocks(prod) == all_free


def test_replayed_params_are_refused_at_once_and_recomputed(ckpt):
    want = _reference(ckpt)
    prod, cons = _pair(ckpt, transfer_timeout_s=60)
    try:
        params = _prefill(prod)
        counts = _count_scheduled(cons)
        assert _decode(cons, params) == want
        assert sum(counts) == 1 + MAX_TOKENS - 1  # pulled: only the last prompt token ran
        counts.clear()
        t0 = time.monotonic()
        assert _decode(cons, params) == want  # the same parameters again: the producer freed those blocks
        replay_s = time.monotonic() - t0
        print(f"replayed params: done after {replay_s:.2f} s (transfer_timeout_s 60)")
        assert replay_s < 30, "the replayed pull waited for transfer_timeout_s (RETRY for a freed request)"
        # refused, so recomputed; the prefix cache of the first decode may hold all but the last block
        assert sum(counts) > MAX_TOKENS
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_the_children_of_an_n4_request_share_one_pull(ckpt):
    want = _reference(ckpt, n=4)
    prod, cons = _pair(ckpt, transfer_timeout_s=60)
    try:
        all_free = _free_blocks(prod)
        params = _prefill(prod)
        counts = _count_scheduled(cons)
        t0 = time.monotonic()
        assert _decode(cons, params, n=4) == want
        took = time.monotonic() - t0
        print(f"n=4: done after {took:.2f} s (transfer_timeout_s 60)")
        assert took < 30, "a sibling waited for transfer_timeout_s"
        assert sum(counts) == 4 * MAX_TOKENS, counts  # each child ran its last prompt token: none recomputed
        assert _wait_all_free(prod, all_free)  # one DONE, after the last sibling was written
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_a_request_aborted_before_its_pull_started_frees_the_producer(ckpt):
    prod, cons = _pair(ckpt, transfer_timeout_s=60)
    engine = cons.llm_engine
    try:
        all_free = _free_blocks(prod)
        params = _prefill(prod)
        assert _free_blocks(prod) < all_free  # held for the consumer, for abort_timeout_s (120 s)
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            extra_args={"kv_transfer_params": dict(params)})  # fmt: skip
        engine.add_request("queued", {"prompt_token_ids": PROMPT}, sp)
        engine.abort_request(["queued"])  # the client left before the consumer scheduled it
        t0 = time.monotonic()
        for _ in range(3):
            engine.step()  # the finished request's DONE goes out with this step's metadata
        assert _wait_all_free(prod, all_free), "the producer still holds the aborted request's blocks"
        print(f"producer freed after {time.monotonic() - t0:.2f} s (abort_timeout_s 120)")
        assert not engine.has_unfinished_requests()
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def _toy_producer(port):
    kvt = KVTransferConfig(kv_connector="P2pZmqConnector", kv_role="kv_producer", kv_port=port)
    cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=4))
    worker = P2pZmqConnector(cfg, KVConnectorRole.WORKER)
    worker.register_kv_caches({f"l{i}": torch.randn(2, 8, 4, 1, 2) for i in range(2)})
    return worker


def _dealer(ctx, port):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _replies(sock, count):
    out = []
    for _ in range(count):
        assert sock.poll(10_000), f"{len(out)} of {count} replies"
        out.append(sock.recv_multipart())
    return out


def test_unread_reads_get_one_copy_per_connection_and_a_freed_request_is_refused():
    port = free_port()
    prod = _toy_producer(port)
    w = prod.connector_worker
    ctx = zmq.Context()
    try:
        with w._lock:
            w._to_send["r"] = ([3, 5], time.time() + 60, "")
        read = json.dumps({"req_id": "r", "tag": "t", "digest": "", "block_ids": [3, 5]}).encode()
        flood = _dealer(ctx, port)
        for _ in range(50):  # sent without reading a reply
            flood.send_multipart([b"READ", read])
        kinds = [r[0] for r in _replies(flood, 50)]
        assert kinds.count(b"OK") == 1 and kinds.count(b"ERROR") == 49  # was 50 copies of the KV
        others = [_dealer(ctx, port) for _ in range(_MAX_READERS)]
        for sock in others:
            sock.send_multipart([b"READ", read])
        kinds = [_replies(sock, 1)[0][0] for sock in others]
        # at most _MAX_READERS connections (the flood's is one); which is refused depends on arrival order
        assert sorted(kinds) == sorted([b"OK"] * (_MAX_READERS - 1) + [b"ERROR"]), kinds
        flood.send_multipart([b"DONE", read])
        assert _replies(flood, 1)[0][0] == b"ACK"
        late = _dealer(ctx, port)
        late.send_multipart([b"READ", read])  # a replay after the DONE
        kind, head = _replies(late, 1)[0][:2]
        assert kind == b"ERROR" and "released" in json.loads(head)["error"]  # was RETRY until the timeout
        late.send_multipart([b"READ", read.replace(b'"r"', b'"never-held"')])
        assert _replies(late, 1)[0][0] == b"RETRY"  # an id never seen may still be on its way
        for sock in (flood, late, *others):
            sock.close(linger=0)
    finally:
        prod.shutdown()
        ctx.destroy(linger=0)
