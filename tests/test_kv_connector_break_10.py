"""Issue 30, tenth break pass: what it found, each with its regression test.

1. A P/D consumer shut down while a pull was reading (a server stopped, or restarted, mid-request) said
   nothing to its producer, which kept the request's blocks until its `abort_timeout_s` (120 s). The pull
   thread now says DONE for each pull still reading before it closes its sockets (chapter 47e,
   `_say_goodbye`).
"""

import time

import pytest
from test_kv_connector_break_8 import PROMPT, FakeProducer, _consumer, _params, _wait  # tests/ is on sys.path

from minivllm import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_a_consumer_shut_down_mid_pull_tells_the_producer_done(ckpt):
    port = get_open_port()
    fake = FakeProducer(port)  # answers every READ with RETRY: the pull keeps reading
    llm = _consumer(ckpt, transfer_timeout_s=30)
    engine = llm.llm_engine
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            extra_args={"kv_transfer_params": _params(port)})  # fmt: skip
        engine.add_request("cut", {"prompt_token_ids": PROMPT}, sp)
        assert _wait(lambda: len(fake.reads) >= 1, 10, engine.step)
        assert fake.dones == []
        t0 = time.monotonic()
        engine.shutdown()
        shutdown_s = time.monotonic() - t0
        assert _wait(lambda: fake.dones, 2), "the producer heard no DONE: it would hold the blocks 120 s"
        assert len(fake.dones) == 1 and fake.dones[0].startswith("cut")
        assert shutdown_s < 5, f"shutdown took {shutdown_s:.1f} s"
    finally:
        engine.shutdown()
        fake.close()


def test_a_consumer_shut_down_mid_pull_to_a_dead_producer_stops_at_once(ckpt):
    port = get_open_port()  # nobody listens: the DONE cannot be delivered
    llm = _consumer(ckpt, transfer_timeout_s=30)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                        extra_args={"kv_transfer_params": _params(port)})  # fmt: skip
    engine.add_request("cut", {"prompt_token_ids": PROMPT}, sp)
    for _ in range(3):
        engine.step()
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < 3  # the half-second linger, not a hang
