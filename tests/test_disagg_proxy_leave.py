"""Clients leaving the disaggregation proxy (examples/disagg_proxy.py) left the producer's blocks held for
nobody until its `abort_timeout_s` (120 s): break pass b12A, item 3. 60 non-streamed clients leaving after
0.05-1.5 s made the proxy cancel 43 prefills and 11 decodes; 27 blocks stayed held, nothing running anywhere.

1. A decode the proxy cancelled (its client left): the decode server aborted the request before its engine saw
   it, so nobody said DONE to the producer. The proxy now releases the parameters of every decode it cancels
   (`release_remote_blocks`: DONE with `prompt_digest` to every producer rank), streamed or not.
2. A prefill whose client left: the proxy cancelled the call, but the producer had finished the request (its
   blocks held for a pull) and the answer naming them was dropped. The prefill now goes on for nobody (at
   most `PREFILL_GRACE_S`) and the proxy releases its answer's parameters.
3. Both together, through a real producer and consumer: a burst of clients leaving at random moments leaves
   no producer block held a few seconds later.

The producer and consumer are in-process servers (tests/test_server.py `Server`) on tiny checkpoints; the
decode server of 1 and the slow link to the producer of 2 are stand-ins (tests/test_disagg_proxy.py
`_Backend`). Every server the tests start is stopped.
"""

import asyncio
import json
import random
import threading
import time
import urllib.request

import httpx
import pytest
from test_disagg_proxy import _Backend, _free_port, disagg_proxy  # tests/ is on sys.path
from test_server import API_KEY, Server

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.openai.api_server import ServerThread
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM
from minivllm.v1.executor.multiproc_executor import get_open_port

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    "A tiny llama; the three in-process servers of a test run one OpenMP thread each (`one_thread`)."
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _server(path, role: str) -> Server:
    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": role}
    if role == "kv_producer":  # 120 s, the default: the old code held the blocks that long
        kvt.update(kv_port=get_open_port(), kv_connector_extra_config={"abort_timeout_s": 120})
    args = EngineArgs(model=path, dtype="float32", max_model_len=256, block_size=16,
                      kv_cache_memory_bytes=1 << 20, kv_transfer_config=kvt)  # fmt: skip
    return Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))


def _held(prod: Server) -> int:
    "The blocks the producer holds (its block pool's used blocks)."
    pool = prod.engine.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is the null block


def _released_within(prod: Server, seconds: float) -> float | None:
    "Seconds until the producer holds no request's blocks, or None if it still does after `seconds`."
    scheduler = prod.engine.engine_core.scheduler
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not scheduler.delayed_free_req_ids and not scheduler.running and not scheduler.waiting:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _assert_released(prod: Server, seconds: float) -> float:
    "Seconds until the producer held nothing for the departed client (asserted within `seconds`)."
    took = _released_within(prod, seconds)
    assert took is not None, f"the producer still holds {_held(prod)} blocks for the departed client"
    prod.wait_idle()
    assert _held(prod) == 0
    return took


def _leave(proxy_url: str, body: dict, after_s: float) -> None:
    "A client that gives up after `after_s` seconds."
    with pytest.raises(httpx.TimeoutException):
        httpx.post(proxy_url + "/v1/completions", json=body, headers=HEADERS, timeout=after_s)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_cancelled_for_a_departing_client_releases_the_producers_blocks(ckpt, stream):
    """1. The decode server holds the request without reaching it (its engine busy); the client leaves after
    0.5 s. Before: the proxy cancelled the decode and said nothing; the producer kept the prompt's 3 blocks
    for 120 s (streamed, the proxy even waited for the decode server's headers first). Now they are back
    within a second."""
    release = threading.Event()

    class Stalled(_Backend):  # answers only when the test ends: a decode server that never got to it
        def __init__(self):
            super().__init__(reply=self._stall)
            self.server.handle_error = lambda request, address: None  # its late answer meets a closed socket

        def _stall(self, path, body):
            release.wait(60)
            return 503, "application/json", b'{"error": {"message": "stopping"}}'

    prod = _server(ckpt, "kv_producer")
    decode = Stalled()
    proxy = ServerThread(disagg_proxy.build_app(prod.url, decode.url, timeout_s=30)).start()
    try:
        assert _held(prod) == 0
        body = {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 4, "stream": stream}
        _leave(proxy.url, body, 0.5)  # the prefill takes well under that: the decode is cancelled
        took = _assert_released(prod, 5)
        print(f"stream={stream}: the producer's blocks came back {took:.2f} s after the client left")
    finally:
        release.set()
        proxy.stop()
        decode.stop()
        prod.stop()


def test_a_prefill_whose_client_left_is_released_when_it_answers(ckpt):
    """2. The producer finishes the prefill (blocks held for a pull) but its answer is 1.5 s on its way (a
    slow link, a busy front end); the client leaves after 0.5 s. Before: the proxy cancelled the call, the
    answer naming the blocks was lost, and the producer kept them 120 s. Now the proxy waits for the answer
    and releases its parameters."""
    prod = _server(ckpt, "kv_producer")
    answered = threading.Event()

    def slow_link(path, body):  # forwards to the producer, then holds its answer 1.5 s
        req = urllib.request.Request(prod.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **HEADERS})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            content = r.read()
        answered.set()
        time.sleep(1.5)
        return 200, "application/json", content

    link = _Backend(reply=slow_link)
    dead = f"http://127.0.0.1:{_free_port()}"  # the decode server is never asked
    proxy = ServerThread(disagg_proxy.build_app(link.url, dead, timeout_s=30)).start()
    try:
        _leave(proxy.url, {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 4}, 0.5)
        assert answered.wait(10)  # the producer finished the request: its blocks are held for a pull
        took = _assert_released(prod, 6)
        print(f"the abandoned prefill's blocks came back {took:.2f} s after the producer answered")
    finally:
        proxy.stop()
        link.stop()
        prod.stop()


def test_a_burst_of_departing_clients_leaves_no_producer_block_held(ckpt):
    """3. 24 non-streamed clients through the proxy to a real producer and consumer, each leaving after
    0.05-1.2 s (some during the prefill, some during the decode). Before: blocks stayed held for 120 s (the
    tester's 60 clients: 27 blocks). Now none is held 5 s after the burst."""
    prod = _server(ckpt, "kv_producer")
    cons = _server(ckpt, "kv_consumer")
    proxy = ServerThread(disagg_proxy.build_app(prod.url, cons.url, timeout_s=30)).start()
    rng = random.Random(3)

    async def one(client: httpx.AsyncClient) -> str:
        start, n = rng.randrange(3, 300), rng.randrange(20, 90)
        max_tokens = rng.randrange(120, 160)  # long enough that most leave, even on a fast machine
        body = {"model": "tiny", "prompt": list(range(start, start + n)), "max_tokens": max_tokens,
                "ignore_eos": True}  # fmt: skip
        try:
            coro = client.post(proxy.url + "/v1/completions", json=body, headers=HEADERS)
            await asyncio.wait_for(coro, rng.uniform(0.05, 1.2))
        except TimeoutError:
            return "left"
        return "answered"

    async def burst() -> list[str]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client) for _ in range(24)))

    try:
        outcomes = asyncio.run(burst())
        assert outcomes.count("left") >= 8, outcomes
        took = _released_within(prod, 8)
        held = _held(prod)
        cons.wait_idle(timeout=60)
        assert took is not None, (
            f"{outcomes.count('left')} clients left; the producer still holds {held} blocks"
        )
        prod.wait_idle()
        assert _held(prod) == 0
        print(f"{outcomes.count('left')} of 24 clients left; the producer was clear {took:.2f} s later")
    finally:
        proxy.stop()
        cons.stop()
        prod.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_decode_that_never_pulled_releases_the_producers_blocks(ckpt, stream):
    """4. (break pass 16, item 4) A decode server that answers without pulling: a consumer whose adapter (or
    weights) differ from the producer's refuses the KV and computes the prompt itself, and its own DONE
    names its prompt's digest, which frees nothing. Before: the proxy released only decodes that failed or
    were cut, and the producer held the blocks for `abort_timeout_s` (120 s). Now every decode's parameters
    are released once it is over; a second DONE after a real pull frees nothing more."""

    def answered(path, body):  # a complete answer, without a pull
        if body.get("stream"):
            return (
                200,
                "text/event-stream",
                b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n',
            )
        return 200, "application/json", b'{"id": "d", "object": "text_completion", "choices": []}'

    prod = _server(ckpt, "kv_producer")
    decode = _Backend(reply=answered)
    proxy = ServerThread(disagg_proxy.build_app(prod.url, decode.url, timeout_s=30)).start()
    try:
        body = {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 4, "stream": stream}
        r = httpx.post(proxy.url + "/v1/completions", json=body, headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text
        took = _assert_released(prod, 5)
        print(f"stream={stream}: the producer's blocks came back {took:.2f} s after the decode answered")
    finally:
        proxy.stop()
        decode.stop()
        prod.stop()
