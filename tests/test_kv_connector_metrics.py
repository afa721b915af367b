"""What a KV connector did, on the metrics (issue 30, item 11): an engine with LMCache (CPU tier) reports
vLLM's external prefix-cache counters (tokens asked of the connector and found) and LMCache's own counts
(`kv_connector_stats`: tokens loaded and stored) in its `SchedulerStats`, and `PrometheusStatLogger`
exports them as `vllm:external_prefix_cache_*` and `vllm:kv_connector_lmcache_*`.
"""
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.metrics.loggers import PrometheusStatLogger

PROMPT = list(range(5, 5 + 40))  # 2 full chunks of 16 before the last token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_lmcache_hits_and_counts_reach_metrics(ckpt):
    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": 16, "local_cpu": True, "max_local_cpu_size": 0.01}}
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 20, kv_transfer_config=kvt, disable_log_stats=False)
    prom = PrometheusStatLogger("tiny")
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    make_stats = scheduler.make_stats

    def recording():
        stats = make_stats()
        prom.record(stats, None)
        return stats

    scheduler.make_stats = recording
    try:
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        cold = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids
        warm = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()
    assert cold == warm
    text = prom.generate().decode()
    m = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert m["vllm:external_prefix_cache_queries_total"] == 2 * len(PROMPT)
    assert m["vllm:external_prefix_cache_hits_total"] == 32  # none cold, two chunks warm
    assert m["vllm:kv_connector_lmcache_stored_tokens_total"] == 32
    assert m["vllm:kv_connector_lmcache_loaded_tokens_total"] == 32
