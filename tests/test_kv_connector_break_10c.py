"""A tenth try-to-break pass on the KV and EC connectors (issue 30): two defects.

1. At tensor-parallel size 2, /metrics showed only rank 0's KV-connector counts: `KVOutputAggregator` kept
   the output rank's `kv_connector_stats`. A load that failed on rank 1 alone (its LMCache chunk damaged:
   logged, deleted, the request recomputed) showed as a clean hit, `lmcache_loaded_tokens` 32 and no
   `lmcache_failed_load_tokens` nor `lmcache_errors`. Every rank's counts are now summed by name, as vLLM
   pools them (`KVConnectorStats.aggregate`): a sharded count is counted once per rank (loaded plus failed
   tokens = tokens looked up x ranks), and the scheduler's external prefix-cache hits count each token once.
2. The EC example connector served encoder outputs stored in another dtype: a bfloat16 producer's outputs
   were cast and merged by a float32 consumer on the same folder, and its logprobs moved (-2.47589 for
   -2.4731). The stored dtype (in the file's header) must now be the engine's, else a miss (a warning, the
   image encoded, the file kept for engines of its dtype); the consumer's answer equals a plain engine's.
"""

import hashlib
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_ec_connector import ec_config, request, runner
from test_kv_connector_tp import KW, _core, _greedy

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import (
    CacheEngineKey,
    ChunkedTokenDatabase,
)
from minivllm.model_executor.model_loader import checkpoint_identity
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.metrics.loggers import PrometheusStatLogger

PROMPT = list(range(5, 5 + 37))  # two full chunks of 16 before the last token


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the TP workers are processes all the same
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _recording(llm) -> PrometheusStatLogger:
    "A Prometheus logger fed every `SchedulerStats` the engine makes (what /metrics would show)."
    prom = PrometheusStatLogger("tiny")
    scheduler = _core(llm).scheduler
    make_stats = scheduler.make_stats

    def recording():
        stats = make_stats()
        prom.record(stats, None)
        return stats

    scheduler.make_stats = recording
    return prom


def _metrics(prom: PrometheusStatLogger) -> dict[str, float]:
    text = prom.generate().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_tp2_every_ranks_connector_counts_reach_metrics(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "m")
    ref = LLM(path, **KW)
    try:
        want = _greedy(ref, [PROMPT])
    finally:
        ref.llm_engine.shutdown()
    disk = tmp_path / "disk"
    kvt = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": 16, "local_cpu": False, "local_disk": str(disk),
                                         "max_local_disk_size": 0.05}}
    llm = LLM(path, tensor_parallel_size=2, **KW, kv_transfer_config=kvt, disable_log_stats=False)
    prom = _recording(llm)
    try:
        assert _greedy(llm, [PROMPT]) == want  # cold: computed, stored by both ranks
        cold = _metrics(prom)
        # damage rank 1's shard of the first chunk: that rank alone fails to load it
        chunk = ChunkedTokenDatabase(16, False, 16).chunk_hashes(PROMPT)[0][2]
        key = CacheEngineKey(checkpoint_identity(str(path)), 2, 1, chunk, "float32")
        f = disk / (hashlib.sha256(key.to_string().encode()).hexdigest() + ".kvchunk")
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0xFF
        f.write_bytes(bytes(raw))
        assert _greedy(llm, [PROMPT]) == want  # warm: rank 1's failure recomputes the prompt
        warm = _metrics(prom)
    finally:
        llm.llm_engine.shutdown()

    def delta(name):
        return warm.get(f"vllm:kv_connector_lmcache_{name}_total", 0) - cold.get(
            f"vllm:kv_connector_lmcache_{name}_total", 0)

    assert cold["vllm:kv_connector_lmcache_stored_tokens_total"] == 2 * 32  # each rank its shard of 2 chunks
    assert delta("failed_load_tokens") == 16  # was: 0, rank 1's failure never reached the metrics
    assert delta("errors") >= 1  # the checksum mismatch rank 1's disk tier counted
    assert delta("loaded_tokens") + delta("failed_load_tokens") == 2 * 32  # both ranks' shards of 32 tokens
    assert warm["vllm:external_prefix_cache_hits_total"] == 32  # the scheduler counts each token once


GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def _answers(llm, requests):
    "Each request's greedy tokens and their logprobs."
    outs = [o.outputs[0] for o in llm.generate(requests, GREEDY_LOGPROBS, use_tqdm=False)]
    return [(c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]) for c in outs]


def test_encoder_outputs_of_another_dtype_are_encoded_again(tmp_path, caplog):
    ckpt = make_tiny_checkpoint("gemma3_mm", tmp_path / "g3mm")
    store = tmp_path / "store"
    requests = [request(1, 2)]
    plain = LLM(ckpt, dtype="float32", block_size=4)
    try:
        want = _answers(plain, requests)
    finally:
        plain.llm_engine.shutdown()
    engines = {}
    try:
        for name, dtype, role in [("producer", "bfloat16", "ec_producer"),
                                  ("bf16", "bfloat16", "ec_consumer"), ("fp32", "float32", "ec_consumer")]:
            engines[name] = LLM(ckpt, dtype=dtype, block_size=4, ec_transfer_config=ec_config(store, role))
        engines["producer"].generate(requests, GREEDY_LOGPROBS, use_tqdm=False)
        files = sorted(store.glob("*/encoder_cache.safetensors"))
        assert len(files) == 2
        engines["bf16"].generate(requests, GREEDY_LOGPROBS, use_tqdm=False)
        assert runner(engines["bf16"]).num_encoder_runs == 0  # its own dtype: loaded, not encoded
        with caplog.at_level(logging.WARNING):
            got = _answers(engines["fp32"], requests)
        assert got == want  # was: the bfloat16 outputs cast, other logprobs
        assert runner(engines["fp32"]).num_encoder_runs >= 1  # encoded again, not loaded
        assert "dtype BF16, this engine computes F32" in caplog.text
        assert all(f.exists() for f in files)  # intact: kept for the bfloat16 engines
    finally:
        for llm in engines.values():
            llm.llm_engine.shutdown()
