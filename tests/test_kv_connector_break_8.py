"""A ninth try-to-break pass on the KV connectors (issue 30: a fault fails fast or recovers, never hangs;
nothing leaks), end to end on P2pZmqConnector's consumer.

1. A consumer request aborted (its client disconnected) while its pull was in flight kept its KV blocks until
   `transfer_timeout_s` (30 s by default): the scheduler held them for the pull and the worker had no way to
   cancel it. The scheduler now names it in the next step's `reqs_to_cancel`; the worker drops the pull,
   reports it received (the scheduler frees the aborted request's blocks at once) and tells the producer
   DONE, so the producer frees its copy too.
2. A pull that timed out was dropped without a DONE: a live but slow producer kept its blocks until
   `abort_timeout_s` (120 s). It now hears DONE.
3. The producer served any unknown message kind as a READ; now it answers ERROR naming the kind (tested in
   chapter 47e, with the cancel's and the late answer's worked examples).

The producer here is a fake: a ZeroMQ ROUTER that answers every READ with RETRY (a producer whose request
is not registered yet, or a slow one) and every DONE with ACK, counting both.
"""

import json
import threading
import time

import pytest
import zmq

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port

PROMPT = list(range(10, 30))  # 20 tokens: five blocks of 4
KW = dict(dtype="float32", max_model_len=64, block_size=4, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


class FakeProducer:
    "A ROUTER on `port` in a thread: READ -> RETRY, DONE -> ACK; `reads` and `dones` count them (by tag)."

    def __init__(self, port: int):
        self.reads: list[str] = []
        self.dones: list[str] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, kind, body = self._sock.recv_multipart()
            tag = json.loads(body).get("tag")
            (self.dones if kind == b"DONE" else self.reads).append(tag)
            answer = b"ACK" if kind == b"DONE" else b"RETRY"
            self._sock.send_multipart([ident, answer, json.dumps({"tag": tag}).encode()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()


def _consumer(ckpt, transfer_timeout_s: float) -> LLM:
    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"transfer_timeout_s": transfer_timeout_s}}  # fmt: skip
    return LLM(ckpt, **KW, kv_transfer_config=kvt)


def _params(port: int) -> dict:
    return {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3, 4, 5], "remote_request_id": "p-0",
            "remote_engine_id": "fake", "remote_host": "127.0.0.1", "remote_port": port}  # fmt: skip


def _free_blocks(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _wait(cond, timeout: float, step=None) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        if step is not None:
            step()
        time.sleep(0.01)
    return True


def test_an_aborted_pull_frees_its_blocks_at_once_and_tells_the_producer(ckpt):
    port = get_open_port()
    fake = FakeProducer(port)
    llm = _consumer(ckpt, transfer_timeout_s=20)
    engine = llm.llm_engine
    try:
        start = _free_blocks(llm)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            extra_args={"kv_transfer_params": _params(port)})  # fmt: skip
        engine.add_request("gone", {"prompt_token_ids": PROMPT}, sp)
        assert _wait(lambda: len(fake.reads) >= 2, 10, engine.step)  # pulling: READ, RETRY, READ again
        assert _free_blocks(llm) < start  # the pull's blocks are reserved
        assert fake.dones == []
        t0 = time.monotonic()
        engine.abort_request(["gone"])  # the client disconnected
        assert _wait(lambda: _free_blocks(llm) == start, 10, engine.step)
        freed_s = time.monotonic() - t0
        print(f"the aborted pull's blocks came back after {freed_s:.3f} s (transfer_timeout_s 20)")
        assert freed_s < 2
        assert _wait(lambda: fake.dones, 2)  # the producer may free its blocks too
        assert len(fake.dones) == 1 and fake.dones[0].startswith("gone")  # the tag: the internal request id
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()
        fake.close()


def test_a_pull_that_times_out_tells_the_producer_done(ckpt):
    port = get_open_port()
    fake = FakeProducer(port)
    llm = _consumer(ckpt, transfer_timeout_s=1)
    try:
        start = _free_blocks(llm)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            extra_args={"kv_transfer_params": _params(port)})  # fmt: skip
        t0 = time.monotonic()
        out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4  # recomputed after the timeout
        assert time.monotonic() - t0 < 10
        assert len(fake.reads) >= 2  # RETRY was repeated until the deadline
        assert _wait(lambda: fake.dones, 2), (
            "no DONE after the timed-out pull: the producer would hold its blocks"
        )
        assert len(fake.dones) == 1
        assert _free_blocks(llm) == start
    finally:
        llm.llm_engine.shutdown()
        fake.close()
