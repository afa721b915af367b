"""Try-to-break pass 17 on the KV connectors (issue 30): a `kv_both` P2pZmqConnector engine that is its own
consumer (a proxy sending prefill and decode to one server) with a small KV cache.

Two prefills' blocks, held for pulls that would come from this same engine, filled 6 of its 7 usable blocks;
the third prompt at the head of the queue did not fit, nothing ran, and the decodes that would pull (and so
free) the held blocks waited behind it: every request took `abort_timeout_s` (120 s). Now, when nothing runs
and no pull is in flight, the scheduler asks the connector for the oldest held request's blocks back
(`Scheduler._reclaim_held_blocks`, `KVConnectorBase_V1.release_held_blocks`, chapters 23 and 47e): its
consumer is refused and recomputes, with the tokens of one instance.
"""

import pytest
from test_kv_connector_pd import free_port

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.request import RequestStatus

MAX_STEPS = 200  # the fix admits the third prompt within a few steps; the stall schedules nothing for 600 s
PROMPTS = [list(range(5 + 50 * i, 5 + 50 * i + 40)) for i in range(3)]  # 3 blocks of 16 each


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _llm(ckpt, kvt=None, blocks=None):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt,
               num_gpu_blocks_override=blocks, enable_prefix_caching=False)

@pytest.fixture
def hole():
    "A TCP socket that listens and never reads: the kernel completes a pull's handshake, nobody answers."
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def _forged(hole, i: int, n: int):
    "(prompt, params) of an n-token request whose pull goes to `hole` (never lands), its own prompt per `i`."
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": hole.getsockname()[1],
              "remote_block_ids": list(range(1, 1 + -(-n // 16))), "remote_request_id": f"x{i}",
              "remote_engine_id": "e"}
    prompt = {"prompt_token_ids": list(range(300 + 40 * i, 300 + 40 * i + n))}
    return prompt, SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params})

def _step_until(engine, wanted: set[str]) -> set[str]:
    "Step `engine` until every request in `wanted` has finished (AssertionError after MAX_STEPS); the finished."
    finished: set[str] = set()
    for _ in range(MAX_STEPS):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if finished >= wanted:
            return finished
    raise AssertionError(f"only {sorted(finished)} finished in {MAX_STEPS} steps")




def test_held_sends_that_fill_a_kv_both_engine_are_freed_for_its_own_queue(ckpt, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = _llm(ckpt)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    finally:
        ref.llm_engine.shutdown()
    both = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_both", "kv_port": free_port(),
                       "kv_connector_extra_config": {"abort_timeout_s": 600}}, blocks=8)
    try:
        engine = both.llm_engine
        prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                 extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"p{i}", {"prompt_token_ids": p}, prefill)
        params = {}
        for _ in range(MAX_STEPS):
            for out in engine.step():
                if out.finished:
                    params[out.request_id] = out.kv_transfer_params
            if len(params) == len(PROMPTS):
                break
        assert len(params) == len(PROMPTS), f"only {sorted(params)} finished in {MAX_STEPS} steps"
        sched = engine.engine_core.engine_core.scheduler
        assert len(sched.delayed_free_req_ids) == 2  # p0 was freed for p2; p1 and p2 are held
        decode = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                 extra_args={"kv_transfer_params": params[f"p{i}"]}) for i in range(3)]
        got = [o.outputs[0].token_ids for o in both.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], decode, use_tqdm=False)]
        assert got == want
        assert not sched.delayed_free_req_ids and not sched.requests  # every held block came back
    finally:
        both.llm_engine.shutdown()


def test_a_clients_malformed_params_make_a_bounded_log_line(ckpt, monkeypatch, caplog):
    """The consumer logged a client's malformed `kv_transfer_params` whole: a 4 MiB `remote_request_id` made a
    4 MiB log line per request (a client could fill the disk at the speed it sends bodies). It is abridged."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"})
    try:
        bad = {"do_remote_prefill": True, "remote_request_id": "r" * (4 << 20), "remote_port": 1,
               "remote_block_ids": list(range(70000))}
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, extra_args={"kv_transfer_params": bad})
        with caplog.at_level("WARNING", logger="minivllm"):
            out = cons.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2  # computed locally
        lines = [r.getMessage() for r in caplog.records if "malformed kv_transfer_params" in r.getMessage()]
        assert lines and max(map(len, lines)) < 1000, [len(x) for x in lines]
    finally:
        cons.llm_engine.shutdown()


def test_a_pull_that_never_lands_does_not_stop_the_reclaim(ckpt, monkeypatch, hole):
    """Pass 18: the reclaim first waited for any pull of this engine's in flight. One request whose
    `kv_transfer_params` point at a socket that accepts and never answers then held every request for
    `transfer_timeout_s` (30 s each, again and again). The held blocks now come back all the same."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    both = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, num_gpu_blocks_override=8,
               enable_prefix_caching=False, scheduling_policy="priority",  # the forged pull queues last
               kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_both", "kv_port": free_port(),
                                   "kv_connector_extra_config": {"abort_timeout_s": 600, "transfer_timeout_s": 600}})
    try:
        engine = both.llm_engine
        engine.add_request("forged", *_forged(hole, 0, 34), priority=9)
        engine.step()  # its 3 blocks reserved, its pull in flight for good
        prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                 extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"p{i}", {"prompt_token_ids": p}, prefill)
        _step_until(engine, {"p0", "p1", "p2"})
        engine.abort_request(["forged"])
    finally:
        both.llm_engine.shutdown()


def test_loads_that_never_land_do_not_hold_back_requests_that_fit(ckpt, monkeypatch, hole):
    """Pass 19: two requests whose pulls go to a peer that never answers hold 6 of 7 usable blocks for
    `transfer_timeout_s`; nothing runs and the head (3 blocks) does not fit. Only requests holding blocks
    could pass it, so small requests that fitted the free block waited the whole timeout too. While loads are
    in flight, any request that fits now runs."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 600}}, blocks=8)
    try:
        engine = cons.llm_engine
        for i in range(2):
            engine.add_request(f"forged{i}", *_forged(hole, i, 40))
        engine.step()  # 6 blocks reserved, both pulls in flight for good
        greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        engine.add_request("head", {"prompt_token_ids": PROMPTS[0]}, greedy)  # 3 blocks: does not fit
        engine.add_request("small", {"prompt_token_ids": list(range(450, 460))}, greedy)  # 1 block: fits
        assert "head" not in _step_until(engine, {"small"})  # it still waits for blocks
        engine.abort_request(["forged0", "forged1", "head"])
    finally:
        cons.llm_engine.shutdown()


def test_new_loads_do_not_pass_a_head_waiting_for_blocks(ckpt, monkeypatch, hole):
    """Pass 20: with rule 5 as first written, every request that fitted passed an unfit head while loads were
    in flight, new pulls included: a stream of small pulls took each block a timed-out pull gave back and the
    head waited as long as the stream lasted (62 s). A request that would start a new load now stays behind
    the head; the head runs once the loads' blocks come back."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 600}}, blocks=8)

    try:
        engine = cons.llm_engine
        sched = engine.engine_core.engine_core.scheduler
        for i in range(2):
            engine.add_request(f"forged{i}", *_forged(hole, i, 40))
        engine.step()  # 6 of 7 blocks reserved by loads that never land
        engine.add_request("head", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        engine.add_request("newload", *_forged(hole, 5, 10))  # one block: it would fit, and keep it from the head
        for _ in range(20):
            engine.step()
        (newload,) = [r for rid, r in sched.requests.items() if rid.startswith("newload")]
        assert newload.status == RequestStatus.WAITING, newload.status  # was WAITING_FOR_REMOTE_KVS
        engine.abort_request(["forged0", "forged1"])
        _step_until(engine, {"head"})
        engine.abort_request(["newload"])
    finally:
        cons.llm_engine.shutdown()
