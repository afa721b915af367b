"""Prefill/decode disaggregation with P2pZmqConnector: a producer engine prefills, a consumer engine pulls
the blocks over ZMQ/TCP and decodes (tiny random checkpoint, float32; both engines in this process).

The consumer's greedy tokens equal one instance's, it runs only the last prompt token through the model,
and the producer's blocks are all free once the consumer said DONE. A producer that is gone makes the
consumer recompute, within its transfer timeout.
"""
import socket
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint

PROMPTS = [list(range(5, 5 + 37)), list(range(300, 300 + 20)), list(range(50, 50 + 16))]
MAX_TOKENS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _llm(ckpt, kvt=None):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)


def _count_scheduled(llm) -> list:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counts, schedule = [], scheduler.schedule

    def counting():
        so = schedule()
        counts.append(so.total_num_scheduled_tokens)
        return so

    scheduler.schedule = counting
    return counts


def _prefill(prod, prompt):
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = prod.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    prod.llm_engine.step()  # the producer's next step registers the request's blocks with its server
    return out


def _decode(cons, prompt, params):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        extra_args={"kv_transfer_params": params})
    return cons.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def _free_blocks(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_producer_consumer_equal_one_instance(ckpt):
    ref = _llm(ckpt)
    expected = [o.outputs[0].token_ids for o in ref.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)]
    ref.llm_engine.shutdown()
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 10}})
    try:
        all_free = _free_blocks(prod)
        counts = _count_scheduled(cons)
        for prompt, want in zip(PROMPTS, expected):
            first = _prefill(prod, prompt)
            params = first.kv_transfer_params
            assert params["do_remote_prefill"] and params["remote_port"] == port
            assert len(params["remote_block_ids"]) == -(-len(prompt) // 16)
            assert _free_blocks(prod) < all_free  # held for the consumer
            counts.clear()
            out = _decode(cons, prompt, params)
            assert out.outputs[0].token_ids == want
            assert out.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]
            assert sum(counts) == 1 + (MAX_TOKENS - 1)  # the last prompt token, then the decode steps
            deadline = time.monotonic() + 10
            while _free_blocks(prod) < all_free and time.monotonic() < deadline:
                prod.llm_engine.step()  # finished_sending reaches the producer's scheduler
            assert _free_blocks(prod) == all_free
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_producer_gone_means_recompute_not_hang(ckpt):
    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    params = _prefill(prod, PROMPTS[0]).kv_transfer_params
    prod.llm_engine.shutdown()  # the producer dies before the consumer pulls
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 1}})
    try:
        counts = _count_scheduled(cons)
        t0 = time.monotonic()
        out = _decode(cons, PROMPTS[0], params)
        assert time.monotonic() - t0 < 20
        assert out.outputs[0].token_ids == want
        assert sum(counts) == len(PROMPTS[0]) + MAX_TOKENS - 1  # everything recomputed
    finally:
        cons.llm_engine.shutdown()


def test_forged_block_ids_are_refused(ckpt):
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 2}})
    try:
        params = dict(_prefill(prod, PROMPTS[0]).kv_transfer_params)
        params["remote_block_ids"] = [b + 1 for b in params["remote_block_ids"]]  # not the request's blocks
        counts = _count_scheduled(cons)
        out = _decode(cons, PROMPTS[0], params)
        assert sum(counts) == len(PROMPTS[0]) + MAX_TOKENS - 1  # refused, so recomputed
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()
