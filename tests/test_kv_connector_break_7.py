"""An eighth try-to-break pass on the KV connectors (issue 30), by a fresh helper.

1. A client chooses the `kv_transfer_params` it sends a P2P consumer. Given one prompt's parameters with
   another prompt of the same length, the consumer pulled the first prompt's KV into blocks that it then
   cached under the second prompt's hashes: every later request with that prompt, from any client and with
   no `kv_transfer_params` at all, decoded from the wrong KV. Each pull now names its prompt
   (`prompt_digest`) and the producer refuses a pull for another prompt than the one it computed: the
   consumer recomputes, nothing wrong is cached, and the producer's blocks stay held for their request.
2. `abort_timeout_s` / `transfer_timeout_s` took any float: NaN held a producer's unpulled blocks forever, inf
   let a pull from a silent peer never end. Now (0, 86400] seconds or a ValueError naming the key (tested in
   chapter 47e).
3. The proxy's one-token prefill kept the client's `min_tokens` (the producer's 400 for a valid request) and
   could stop on EOS (no blocks handed over). Tested in tests/test_disagg_proxy.py.
4. LMCache and ExampleConnector keyed stored KV by the model's *path*: a new checkpoint deployed at the same
   path (or two deployments both serving `./model` over one Redis or folder) decoded from the old weights'
   KV, silently. The EC example connector had the same gap for encoder outputs. Keys now carry
   `checkpoint_identity` (a content hash of config.json and the weights, chapter 36).
"""

import shutil
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port

A = list(range(10, 30))  # 20 tokens: five blocks of 4
B = list(range(200, 220))  # the same length, other tokens
KW = dict(dtype="float32", max_model_len=64, block_size=4, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True)


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _greedy(llm, prompt, params=None, n=8):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)  # fmt: skip
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def test_another_prompts_params_do_not_poison_the_consumers_prefix_cache(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    ref = LLM(path, **KW)
    try:
        want_a, want_b = (list(_greedy(ref, p).outputs[0].token_ids) for p in (A, B))
    finally:
        ref.llm_engine.shutdown()
    prod = LLM(path, **KW, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer",
                                               "kv_port": get_open_port()})  # fmt: skip
    cons = LLM(path, **KW, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                                               "kv_connector_extra_config": {"transfer_timeout_s": 10}})  # fmt: skip
    try:
        pool = prod.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        params = _greedy(prod, A, {"do_remote_decode": True}, n=1).kv_transfer_params
        assert list(_greedy(cons, B, params).outputs[0].token_ids) == want_b  # refused, so recomputed
        assert list(_greedy(cons, B).outputs[0].token_ids) == want_b  # was: A's KV from the prefix cache
        assert pool.get_num_free_blocks() < free  # the producer still holds A's blocks for A's request
        assert list(_greedy(cons, A, params).outputs[0].token_ids) == want_a  # which pulls them
        deadline = time.monotonic() + 10
        while pool.get_num_free_blocks() < free and time.monotonic() < deadline:
            prod.llm_engine.step()  # the consumer's DONE reaches the producer's scheduler
        assert pool.get_num_free_blocks() == free
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def _stored_kv_connector(kind: str, root) -> dict:
    if kind == "ExampleConnector":
        return {"kv_connector": kind, "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(root / "ex")}}  # fmt: skip
    return {"kv_connector": kind, "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": 8, "local_cpu": False, "local_disk": str(root / "lmc"),
                                          "max_local_disk_size": 0.01}}  # fmt: skip


def _run(path, prompt, kvt=None):
    from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none

    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, kv_cache_memory_bytes=4 << 20, kv_transfer_config=kvt)
    try:
        out = list(_greedy(llm, prompt, n=6).outputs[0].token_ids)
        connector = get_kv_transfer_group_or_none()
        if kvt and kvt["kv_connector"] == "LMCacheConnectorV1":
            connector.storage.flush()  # the disk tier's writes land before the next engine reads
        return out
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("kind", ["ExampleConnector", "LMCacheConnectorV1"])
def test_a_new_checkpoint_at_the_same_path_does_not_load_the_old_ones_kv(tmp_path, kind):
    model = tmp_path / "model"
    prompt = list(range(10, 43))
    kvt = _stored_kv_connector(kind, tmp_path)
    make_tiny_checkpoint("llama", model, seed=0)
    old = _run(model, prompt, kvt)  # the old weights fill the tier
    assert _run(model, prompt, kvt) == old  # read back by a new engine: the same tokens
    shutil.rmtree(model)
    make_tiny_checkpoint("llama", model, seed=1)  # a new version, deployed in place
    want = _run(model, prompt)
    assert want != old
    assert _run(model, prompt, kvt) == want  # was: the old weights' KV, the old tokens
