"""KV connectors on a hybrid model (issue 30, item 7): Gemma 3 has sliding-window and full-attention
layers, two KV cache groups with different block ids. A connector that does not declare `SupportsHMA`
sees only one list of block ids, so (as vLLM v0.15 does) a KV connector turns the hybrid KV cache
manager off: the sliding layers' specs become `FullAttentionSpec(sliding_window=w)`, one group, and
the window is still applied in attention. Before this, the consumer's tokens differed from one instance's.

P/D with P2pZmqConnector on a tiny Gemma 3 gives one instance's greedy tokens and the consumer computes only
the last prompt token; asking for the hybrid manager with such a connector is refused, naming the flags.
"""
import socket

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.kv_cache_interface import FullAttentionSpec

PROMPTS = [list(range(5, 5 + 37)), list(range(300, 300 + 20)), list(range(50, 50 + 11))]
MAX_TOKENS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    # 4 layers: sliding (window 8), full, sliding, full -> two groups without a connector
    return make_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), num_hidden_layers=4)


def _llm(path, kvt=None, **kw):
    return LLM(path, dtype="float32", max_model_len=128, block_size=4, kv_cache_memory_bytes=8 << 20,
               kv_transfer_config=kvt, **kw)


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _greedy(llm, prompts, params=None):
    sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          extra_args={"kv_transfer_params": p} if p else None)
           for p in params or [None] * len(prompts)]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                         use_tqdm=False)]


def test_gemma3_pd_equals_one_instance(gemma):
    ref = _llm(gemma)
    groups = ref.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
    assert len(groups) == 2  # hybrid manager on without a connector
    expected = _greedy(ref, PROMPTS)
    ref.llm_engine.shutdown()
    port = free_port()
    prod = _llm(gemma, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    cons = _llm(gemma, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"transfer_timeout_s": 10}})
    try:
        for llm in (prod, cons):
            cfg = _core(llm).scheduler.kv_cache_manager.kv_cache_config
            assert len(cfg.kv_cache_groups) == 1, cfg.kv_cache_groups
            spec = cfg.kv_cache_groups[0].kv_cache_spec
            assert type(spec) is FullAttentionSpec and spec.sliding_window == 8
        params = []
        for p in PROMPTS:
            sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            params.append(prod.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].kv_transfer_params)
            prod.llm_engine.step()
        scheduler = _core(cons).scheduler
        counts, schedule = [], scheduler.schedule

        def counting():
            so = schedule()
            counts.append(dict(so.num_scheduled_tokens))
            return so

        scheduler.schedule = counting
        got = [_greedy(cons, [p], [pp])[0] for p, pp in zip(PROMPTS, params)]
        assert got == expected
        # the consumer ran only the last prompt token of each prompt, then one token per decode step
        assert counts and all(n == 1 for c in counts for n in c.values()), counts
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_hybrid_manager_with_a_connector_without_hma_is_refused(gemma):
    with pytest.raises(ValueError, match="--kv-transfer-config.*--no-disable-hybrid-kv-cache-manager"):
        _llm(gemma, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": "/tmp/unused"}},
             disable_hybrid_kv_cache_manager=False)
