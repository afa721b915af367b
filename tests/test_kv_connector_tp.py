"""KV connectors under tensor parallelism (issue 30, item 8): TP=2 through the mp executor (two worker
processes on the CPU, gloo), each rank moving its own KV heads.

- ExampleConnector stores one file per rank (`<key>.tp<r>of2.safetensors`; the shards overwrote each other
  under one key before) and LMCache one chunk per `worker_id` (layer-wise and synchronous), with a lookup
  server per rank: cold and warm
  runs give the greedy tokens of one instance without a connector, and the warm run loads (it schedules
  only the prompt's tail);
- P/D with P2pZmqConnector, both instances at TP=2 (one port per rank): the consumer's tokens equal one
  instance's, it computes only the last prompt token, and the producer frees its blocks once *both* ranks
  were pulled (the executor's KVOutputAggregator counts the ranks);
- pipeline parallelism with a KV connector is refused, naming the flags.
"""
import socket
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint

PROMPTS = [list(range(5, 5 + 37)), list(range(300, 300 + 20))]
MAX_TOKENS = 4
KW = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20,
          enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the workers are processes all the same
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(path, **KW)
    try:
        return path, _greedy(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


def _greedy(llm, prompts, params=None):
    sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          extra_args={"kv_transfer_params": p} if p else None)
           for p in params or [None] * len(prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _count_scheduled(llm) -> list:
    scheduler = _core(llm).scheduler
    counts, schedule = [], scheduler.schedule

    def counting():
        so = schedule()
        counts.append(dict(so.num_scheduled_tokens))
        return so

    scheduler.schedule = counting
    return counts


def _first_chunks(counts) -> dict:
    "req index in arrival order -> tokens scheduled in its first step."
    first: dict = {}
    for c in counts:
        for rid, n in c.items():
            first.setdefault(rid, n)
    return first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "connector", ["ExampleConnector", "LMCacheConnectorV1", "LMCacheConnectorV1-synchronous"]
)
def test_tp2_cold_and_warm_equal_no_connector(llama, tmp_path, connector):
    path, expected = llama
    if connector == "ExampleConnector":
        extra = {"shared_storage_path": str(tmp_path)}
    else:
        extra = {"chunk_size": 16, "local_cpu": True, "max_local_cpu_size": 0.01}
        if connector.endswith("-synchronous"):  # the default is layer by layer, on each rank's threads
            connector = "LMCacheConnectorV1"
            extra["use_layerwise"] = False
    llm = LLM(path, tensor_parallel_size=2, **KW,
              kv_transfer_config={"kv_connector": connector, "kv_role": "kv_both",
                                  "kv_connector_extra_config": extra})
    try:
        assert type(_core(llm).model_executor).__name__ == "MultiprocExecutor"
        counts = _count_scheduled(llm)
        assert _greedy(llm, PROMPTS) == expected  # cold: computed and saved
        cold = _first_chunks(counts)
        counts.clear()
        assert _greedy(llm, PROMPTS) == expected  # warm: loaded from the connector
        warm = _first_chunks(counts)
    finally:
        llm.llm_engine.shutdown()
    assert sorted(cold.values()) == sorted(len(p) for p in PROMPTS)
    # the full blocks before the last prompt token came from the connector: only the tail was computed
    assert sorted(warm.values()) == sorted(len(p) - (len(p) - 1) // 16 * 16 for p in PROMPTS)
    if connector == "ExampleConnector":
        files = sorted(f.name.split(".", 1)[1] for f in tmp_path.glob("*.safetensors"))
        assert files and set(files) == {"tp0of2.safetensors", "tp1of2.safetensors"}
        assert files.count("tp0of2.safetensors") == files.count("tp1of2.safetensors")


def test_tp2_pd_equals_one_instance(llama):
    path, expected = llama
    port = _free_port()
    while True:  # rank 1 serves on port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                port = _free_port()
    prod = LLM(path, tensor_parallel_size=2, **KW,
               kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer",
                                   "kv_port": port})
    cons = LLM(path, tensor_parallel_size=2, **KW,
               kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                                   "kv_connector_extra_config": {"transfer_timeout_s": 20}})
    try:
        pool = _core(prod).scheduler.kv_cache_manager.block_pool
        all_free = pool.get_num_free_blocks()
        params = []
        for p in PROMPTS:
            sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            params.append(prod.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].kv_transfer_params)
            prod.llm_engine.step()
        assert pool.get_num_free_blocks() < all_free  # held for the consumer
        counts = _count_scheduled(cons)
        got = [_greedy(cons, [p], [pp])[0] for p, pp in zip(PROMPTS, params)]
        assert got == expected
        assert counts and all(n == 1 for c in counts for n in c.values()), counts  # only the last token
        deadline = time.monotonic() + 20
        while pool.get_num_free_blocks() < all_free and time.monotonic() < deadline:
            prod.llm_engine.step()  # both ranks' finished_sending reach the producer's scheduler
        assert pool.get_num_free_blocks() == all_free
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_pipeline_parallel_with_a_kv_connector_is_refused(llama, tmp_path):
    with pytest.raises(ValueError, match="--pipeline-parallel-size.*--kv-transfer-config"):
        LLM(llama[0], pipeline_parallel_size=2, **KW,
            kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
