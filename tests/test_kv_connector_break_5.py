"""A sixth try-to-break pass on the KV connectors (issue 30): LMCache's tiers failing under a running server.

1. LMCache's disk tier asked `Path.is_file` whether a chunk's file exists. For a missing file that answers
   False, but for any other error of `stat` it raises: `EACCES` once the folder lost its search bit (a user's
   `chmod 444 /tmp/lmcache` to make it "read-only"), `EIO` from a failing disk, `ESTALE` from a remounted NFS
   share. The worker asks it before its saves, in the engine's step: `minivllm serve` died ("EngineCore
   process died unexpectedly") on the next request, and so did every restart while the folder stayed so.
   Such an error is now a miss (recomputed), counted and logged once. Root is exempt from permission checks,
   so as root the test stands in for the kernel with a `stat` that refuses.
2. A stopped Redis or a disk tier whose folder was removed were counted only inside the store (`stats()`);
   /metrics showed nothing (the requests still succeeded: the CPU tier served them). The store's errors and
   Redis outages are now `vllm:kv_connector_lmcache_errors` / `..._remote_outages`.
3. A completion of several prompts (or any request with `n` > 1) through the disaggregation proxy: the P2P
   producer held every prompt's (every sample's) blocks for a consumer, but the response names at most one
   set in its one `kv_transfer_params`, so the others stayed held for nobody until `abort_timeout_s` (120 s):
   five batches of four prompts filled 97% of a small producer's KV cache. The server now serves such a
   request without `do_remote_decode` (a warning), and the proxy asks its prefill server for `n = 1`.
4. ExampleConnector had the fault of 1 in its `_stored` (asked by the scheduler): a `shared_storage_path`
   without its search bit killed the engine on the next request (PermissionError). Now "not stored".
"""

import errno
import os
import shutil
import stat
from pathlib import Path
from unittest import mock

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_lmcache_connector import RedisServer, _need_redis  # tests/ is on sys.path

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.metrics.loggers import PrometheusStatLogger

KW = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20,
          enable_prefix_caching=False)  # fmt: skip
PROMPTS = [list(range(5, 5 + 37)), list(range(300, 300 + 40))]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(path, **KW)
    try:
        return path, _greedy(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


def _greedy(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _lmcache(**extra) -> dict:
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": 16, "local_cpu": False, **extra}}  # fmt: skip


class _Unsearchable:
    """`folder` loses its search bit: `chmod 444` as a normal user; as root (exempt from the check) a `stat`
    of a path inside it raises EACCES, as the kernel does for everyone else."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        if os.geteuid() != 0:
            os.chmod(self.folder, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
            self.patch = None
            return self
        real = Path.is_file

        def is_file(p: Path) -> bool:
            if p.parent == self.folder:
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real(p)

        self.patch = mock.patch.object(Path, "is_file", is_file)
        self.patch.start()
        return self

    def __exit__(self, *exc):
        if self.patch is not None:
            self.patch.stop()
        os.chmod(self.folder, 0o755)


def test_an_unsearchable_disk_folder_is_a_miss_not_a_dead_engine(llama, tmp_path):
    path, want = llama
    folder = tmp_path / "lmcache"
    llm = LLM(path, **KW, kv_transfer_config=_lmcache(local_disk=str(folder), max_local_disk_size=0.01))
    try:
        assert _greedy(llm, PROMPTS[:1]) == want[:1]  # stores its two chunks
        store = get_kv_transfer_group_or_none().storage
        store.flush()
        assert len(list(folder.glob("*.kvchunk"))) == 2
        with _Unsearchable(folder):
            assert _greedy(llm, PROMPTS) == want  # was: EngineDeadError (PermissionError in the step)
            assert _greedy(llm, PROMPTS) == want
        assert store.stats()["errors"] > 0
        assert _greedy(llm, PROMPTS) == want  # the folder answers again: loads from it
        assert store.hits["LocalDiskBackend"] >= 2
    finally:
        llm.llm_engine.shutdown()


def _metrics(prom) -> dict:
    text = prom.generate().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_stopped_redis_and_a_removed_disk_folder_show_on_metrics(llama, tmp_path):
    _need_redis()
    path, want = llama
    folder = tmp_path / "lmcache"
    redis = RedisServer()
    kvt = _lmcache(local_cpu=True, max_local_cpu_size=0.01, local_disk=str(folder), max_local_disk_size=0.01,
                   remote_url=redis.url)  # fmt: skip
    llm = LLM(path, **KW, kv_transfer_config=kvt, disable_log_stats=False)
    prom = PrometheusStatLogger("tiny")
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    make_stats = scheduler.make_stats

    def recording():
        stats = make_stats()
        prom.record(stats, None)
        return stats

    scheduler.make_stats = recording
    try:
        assert _greedy(llm, PROMPTS[:1]) == want[:1]
        get_kv_transfer_group_or_none().storage.flush()
        m = _metrics(prom)
        assert m.get("vllm:kv_connector_lmcache_errors_total", 0) == 0  # all well so far
        redis.stop()
        shutil.rmtree(folder)
        assert _greedy(llm, PROMPTS[1:]) == want[1:]  # new chunks: the disk and Redis writes fail
        get_kv_transfer_group_or_none().storage.flush()
        assert _greedy(llm, PROMPTS) == want  # a step after the failed writes reports them
        m = _metrics(prom)
        assert m.get("vllm:kv_connector_lmcache_remote_outages_total", 0) == 1, m
        assert m.get("vllm:kv_connector_lmcache_errors_total", 0) >= 2, m  # Redis once, the disk per chunk
    finally:
        llm.llm_engine.shutdown()
        redis.stop()


def _producer_server(path):
    from test_server import Server

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.v1.engine.async_llm import AsyncLLM
    from minivllm.v1.executor.multiproc_executor import get_open_port

    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": get_open_port()}
    args = EngineArgs(model=path, **KW, kv_transfer_config=kvt)
    return Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))


def test_a_batch_or_n_above_1_holds_no_producer_blocks(llama):
    path, _ = llama
    server = _producer_server(path)
    try:
        scheduler = server.engine.engine_core.scheduler
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        remote = {"do_remote_decode": True}
        prompts = [list(range(5 + i, 5 + i + 40)) for i in range(3)]
        status, batch = server.post("/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 1,
                                                        "kv_transfer_params": remote})  # fmt: skip
        assert status == 200 and len(batch["choices"]) == 3 and batch.get("kv_transfer_params") is None
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 30}], "max_tokens": 1, "n": 2}
        status, sampled = server.post("/v1/chat/completions", dict(chat, kv_transfer_params=remote))
        assert status == 200 and len(sampled["choices"]) == 2
        server.wait_idle()
        assert scheduler.delayed_free_req_ids == set()  # was: 5 requests' blocks held for 120 s
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
        status, one = server.post("/v1/completions", {"model": "tiny", "prompt": prompts[0], "max_tokens": 1,
                                                      "kv_transfer_params": remote})  # fmt: skip
        assert status == 200 and one["kv_transfer_params"]["do_remote_prefill"] is True  # one: still held
        assert len(scheduler.delayed_free_req_ids) == 1
    finally:
        server.stop()


def test_example_connector_unsearchable_folder_is_computed_not_a_dead_engine(llama, tmp_path):
    path, want = llama
    folder = tmp_path / "kv"
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(folder)}}  # fmt: skip
    llm = LLM(path, **KW, kv_transfer_config=kvt)
    try:
        assert _greedy(llm, PROMPTS[:1]) == want[:1]
        assert len(list(folder.glob("*.safetensors"))) == 2
        with _Unsearchable(folder):
            assert _greedy(llm, PROMPTS) == want  # was: PermissionError out of the scheduler, engine dead
        assert _greedy(llm, PROMPTS) == want
    finally:
        llm.llm_engine.shutdown()
