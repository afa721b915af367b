"""Two LMCache engines configured with one `engine_id` (break pass 15B, item 2): both bound the lookup socket
`minivllm-lmcache-<sha1(engine_id)>-0.sock`, the second taking it over; the first one's shutdown deleted the
second one's socket file, and after the second one's first slow lookup (its client reconnects) every lookup
waited the 5 s timeout and missed, for good (rounds of 4 prompts: 15.4 s, 15.1 s, no hit again). Now the path
is made from `engine_id` and the config's `instance_id` (`lookup_engine_id`, chapter 48b), fresh for each
engine start. Tiny random llama, float32, both engines in this process.
"""

import os

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint

PROMPTS = [list(range(3, 3 + 40)), list(range(100, 100 + 36))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _llm(ckpt) -> LLM:
    extra = {"chunk_size": 16, "local_cpu": True, "max_local_cpu_size": 0.01}
    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "engine_id": "prod",
           "kv_connector_extra_config": extra}  # fmt: skip
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False,
               kv_transfer_config=kvt)  # fmt: skip


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _lookup_path(llm: LLM) -> str:
    connector = _core(llm).model_executor.driver_worker.model_runner.kv_connector
    return connector._worker.lookup_path.removeprefix("ipc://")


def _greedy(llm: LLM) -> tuple[list[list[int]], int]:
    "Greedy tokens of PROMPTS, and the prompt tokens the store supplied (the connector's matched tokens)."
    scheduler = _core(llm).scheduler
    hits = []
    lookup = scheduler.connector.get_num_new_matched_tokens

    def counting(request, num_computed_tokens):
        n, is_async = lookup(request, num_computed_tokens)
        hits.append(n or 0)
        return n, is_async

    scheduler.connector.get_num_new_matched_tokens = counting
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    scheduler.connector.get_num_new_matched_tokens = lookup
    return [o.outputs[0].token_ids for o in outs], sum(hits)


def test_the_first_engines_exit_leaves_the_second_ones_lookup_socket(ckpt):
    """Before: one path for both, gone with the first engine's shutdown. Now two paths; the second engine's
    socket stays, and a lookup through a fresh connection (as after a timeout) still finds its store."""
    first = _llm(ckpt)
    second = _llm(ckpt)
    try:
        assert _lookup_path(first) != _lookup_path(second)
        expected, cold_hits = _greedy(second)
        assert cold_hits == 0
        first.llm_engine.shutdown()
        assert os.path.exists(_lookup_path(second))
        client = _core(second).scheduler.connector._scheduler.lookup_client
        client._sock.close(linger=0)  # what a timed-out lookup does: a new socket on the same path
        client._socks[0] = client._connect()
        tokens, warm_hits = _greedy(second)
        assert tokens == expected and warm_hits >= 64, warm_hits
    finally:
        first.llm_engine.shutdown()
        second.llm_engine.shutdown()
