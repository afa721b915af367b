"""KV cache events through a real engine: a ZMQ subscriber's replica of the cached blocks equals the block
pool's after a run with evictions, sequence numbers have no gaps, and a late subscriber catches up by replay."""
import time
from collections import Counter

import msgspec
import pytest
import zmq

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.core.kv_cache_utils import get_block_hash


def _apply(replica: Counter, batch: KVEventBatch) -> None:
    "A multiset: two blocks may hold the same hash (minivllm does not de-duplicate), each is stored and removed."
    for e in batch.events:
        if isinstance(e, BlockStored):
            replica.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            replica.subtract(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            replica.clear()
    for k in [k for k, n in replica.items() if n <= 0]:
        del replica[k]


def _drain(sock, timeout_ms=500):
    out = []
    while sock.poll(timeout_ms):
        _, seq, payload = sock.recv_multipart()
        out.append((int.from_bytes(seq, "big", signed=True), msgspec.msgpack.decode(payload, type=KVEventBatch)))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_subscriber_replica_equals_block_pool(ckpt, tmp_path):
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, num_gpu_blocks_override=12,
              kv_events_config=cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    time.sleep(0.3)
    try:
        prompts = [{"prompt_token_ids": list(range(10 * i, 10 * i + 40))} for i in range(8)]  # 8 x 3 blocks > pool
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        got = _drain(sub)
        seqs = [s for s, _ in got]
        assert seqs == list(range(len(seqs))) and len(seqs) >= 2  # gapless from 0
        assert any(isinstance(e, BlockRemoved) for _, b in got for e in b.events)  # the small pool evicted
        replica = Counter()
        for _, batch in got:
            _apply(replica, batch)
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        held = Counter(get_block_hash(key) for key, _ in pool.cached_block_hash_to_block.items())
        assert replica == held and len(held) > 0
        late = ctx.socket(zmq.DEALER)
        late.connect(replay)
        late.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
        replayed, again = [], Counter()
        while True:
            _, seq, payload = late.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                break
            replayed.append(int.from_bytes(seq, "big", signed=True))
            _apply(again, msgspec.msgpack.decode(payload, type=KVEventBatch))
        assert replayed == seqs and again == held
        llm.reset_prefix_cache()
        llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
        last = _drain(sub)
        assert any(isinstance(e, AllBlocksCleared) for _, b in last for e in b.events)
        assert last[0][0] == seqs[-1] + 1
        late.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        llm.llm_engine.shutdown()


def test_block_residency_metrics_reach_prometheus(ckpt):
    "Stats on, every block sampled, a pool too small: evictions become vllm:kv_block_* histogram samples."
    from prometheus_client import generate_latest

    from minivllm.v1.metrics.loggers import PrometheusStatLogger

    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, num_gpu_blocks_override=12,
              disable_log_stats=False, kv_cache_metrics_sample=1.0)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.kv_metrics_collector is not None
        logger, seen = PrometheusStatLogger("tiny"), []
        make_stats = scheduler.make_stats

        def recording_make_stats():  # what the engine core sends each step, also fed to a Prometheus logger
            stats = make_stats()
            seen.extend(stats.kv_cache_eviction_events)
            logger.record(stats, None)
            return stats

        scheduler.make_stats = recording_make_stats
        prompts = [{"prompt_token_ids": list(range(10 * i, 10 * i + 40))} for i in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert seen, "no eviction was sampled"
        assert all(e.lifetime_seconds >= e.idle_seconds >= 0 for e in seen)
        text = generate_latest(logger.registry).decode()
        count = [line for line in text.splitlines() if line.startswith("vllm:kv_block_lifetime_seconds_count")]
        assert count and float(count[0].split()[-1]) == len(seen)
        assert "vllm:kv_block_idle_before_evict_seconds_bucket" in text
    finally:
        llm.llm_engine.shutdown()
