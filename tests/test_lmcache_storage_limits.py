"""LMCache storage tiers at their limits (pass 17B, findings F3-F5).

F3. `max_local_disk_size` bounded one engine's files, not the folder: two engines sharing a disk folder held
    twice the cap, and a file one evicted stayed in the other's index (its `get` was a FileNotFoundError miss
    that kept the entry and its bytes), so that one evicted real entries early. Now a gone file leaves the
    index (`get`, `contains`) and a `put` rescans the folder at most every `rescan_s` seconds, adopting other
    writers' files, so the folder stays within the cap.
F4. A CPU or disk tier smaller than one chunk stored nothing, silently. Now `set_chunk_layout` (called when
    the KV caches are registered, so at engine start) raises a ValueError naming the field, the chunk's
    bytes and the least size in GB.
F5. A Redis answering every write with an error (OOM under `maxmemory` + `noeviction`) logged one WARNING
    per command. Now it is logged once per command until that command succeeds again (each one counted).
"""

import logging
import os
import shutil
import time

import pytest
import torch

from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration import storage_backend as sb
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
    LocalDiskBackend,
    RemoteBackend,
    StorageManager,
    serialize_kv,
)
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import (
    CacheEngineKey,
    LMCacheEngineConfig,
)

CHUNK = torch.arange(2 * 2 * 16 * 1 * 8, dtype=torch.float32).reshape(2, 2, 16, 1, 8)


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, f"{i:064x}", "float32")


def _folder_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.kvchunk"))


def _capture(logger_name: str) -> tuple[list[logging.LogRecord], logging.Handler]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger(logger_name).addHandler(handler)
    return records, handler


def test_gone_file_leaves_the_index(tmp_path):
    "F3: another engine evicted the file: get / contains miss and drop the entry and its bytes."
    one = len(serialize_kv(CHUNK, _key(0)))
    disk = LocalDiskBackend(tmp_path, max_bytes=4 * one)
    for i in range(3):
        assert disk.put(_key(i), CHUNK + i)
    disk._file(_key(0)).unlink()  # what the other engine's eviction does
    disk._file(_key(1)).unlink()
    assert disk.get(_key(0)) is None and not disk.contains(_key(1))
    assert (len(disk._index), disk.used_bytes) == (1, one)  # was 3 entries, 3 files' bytes
    for i in range(3, 6):  # room for three more before anything real is evicted
        assert disk.put(_key(i), CHUNK + i)
    assert disk.num_evictions == 0 and torch.equal(disk.get(_key(2)), CHUNK + 2)


def test_two_tiers_on_one_folder_stay_within_the_cap(tmp_path):
    "F3: two LocalDiskBackend objects on one folder: the folder's bytes stay within max_bytes."
    one = len(serialize_kv(CHUNK, _key(0)))
    a = LocalDiskBackend(tmp_path, max_bytes=5 * one)
    b = LocalDiskBackend(tmp_path, max_bytes=5 * one)
    a.rescan_s = b.rescan_s = 0  # look at every put (set after: old code fails on the folder, not a kwarg)
    for i in range(8):  # interleaved, as two engines' write-back threads are
        assert a.put(_key(i), CHUNK + i) and b.put(_key(100 + i), CHUNK + i)
        assert _folder_bytes(tmp_path) <= 5 * one
    assert a.used_bytes <= a.max_bytes and b.used_bytes <= b.max_bytes
    # the last write survives (files of one clock tick share an mtime, so which older ones go may vary);
    # a rescan makes each index the folder exactly
    assert torch.equal(b.get(_key(107)), CHUNK + 7)
    present = {p.name for p in tmp_path.glob("*.kvchunk")}
    for t in (a, b):
        t._rescan()
        assert set(t._index) == present and t.used_bytes == _folder_bytes(tmp_path)


def test_rescan_is_rate_limited(tmp_path):
    "F3: the folder is listed at most every rescan_s seconds; once due, a put accounts others' files."
    one = len(serialize_kv(CHUNK, _key(0)))
    a = LocalDiskBackend(tmp_path, max_bytes=3 * one)
    other = LocalDiskBackend(tmp_path, max_bytes=100 * one)
    a.rescan_s = other.rescan_s = 3600
    for i in range(3):
        assert other.put(_key(100 + i), CHUNK)
    assert a.put(_key(0), CHUNK) and a.num_evictions == 0  # not due: a does not look
    assert _folder_bytes(tmp_path) == 4 * one
    for f in tmp_path.glob("*.kvchunk"):  # one clock tick: equal mtimes, so a's own order decides
        os.utime(f, ns=(10**18, 10**18))
    a._last_scan = time.monotonic() - 3600
    assert a.put(_key(1), CHUNK)
    assert _folder_bytes(tmp_path) <= 3 * one and a.num_evictions == 2  # the other's two oldest went
    assert a.contains(_key(0)) and a.contains(_key(1))  # its own recent chunks stay


def _manager(**sizes) -> StorageManager:
    return StorageManager(LMCacheEngineConfig(chunk_size=32, **sizes))


@pytest.mark.parametrize(
    "sizes, field, need",
    [
        (dict(max_local_cpu_size=1e-6), "max_local_cpu_size", 32 * 2 * 2 * 2 * 16 * 4),
        (dict(local_cpu=False, max_local_disk_size=1e-5), "max_local_disk_size", None),
    ],
)
def test_tier_smaller_than_a_chunk_is_refused(tmp_path, sizes, field, need):
    "F4: set_chunk_layout names the field, the chunk's bytes and a size (GB) that does hold one."
    if "max_local_disk_size" in sizes:
        sizes["local_disk"] = str(tmp_path)
    manager = _manager(**sizes)
    try:
        with pytest.raises(ValueError, match=field) as err:
            manager.set_chunk_layout((2, 2, 2, 16), "float32")
    finally:
        manager.close()
    msg = str(err.value)
    assert f"{field} = {sizes[field]:g} GB" in msg and "at least" in msg
    if need is not None:
        assert f"{need} bytes" in msg
    least = float(msg.rsplit("at least ", 1)[1].split()[0])
    fits = _manager(**dict(sizes, **{field: least}))
    try:
        fits.set_chunk_layout((2, 2, 2, 16), "float32")  # the size the message names is enough
        kv = torch.zeros(2, 2, 32, 2, 16)
        fits.put(_key(1), kv)
        assert fits.flush()
        assert fits.contains(_key(1)) == fits.tiers[0].name  # and the tier really holds a chunk
    finally:
        fits.close()


def test_tiny_tier_fails_the_engine_at_start(tmp_path):
    "F4 end to end: the engine refuses to start (before any request) with a CPU tier of 1e-6 GB."
    from minivllm import LLM
    from minivllm.config import KVTransferConfig
    from minivllm.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("llama", tmp_path / "llama")
    extra = {"chunk_size": 32, "local_cpu": True, "max_local_cpu_size": 1e-6}
    kvt = KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config=extra
    )
    with pytest.raises(ValueError, match="max_local_cpu_size = 1e-06 GB .* at least 1.53e-05 GB"):
        LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)


class _FullRedis:
    "A client of a full server (noeviction): EXISTS answers, SET is refused while `full`."

    full = True

    def exists(self, name):
        return 0

    def set(self, name, value):
        import redis

        if self.full:
            raise redis.exceptions.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        return True


def test_redis_error_answers_are_logged_once_per_command():
    "F5: twenty refused writes between answered lookups: 20 errors, 1 warning; a success re-arms it."
    pytest.importorskip("redis")
    remote = RemoteBackend("redis://127.0.0.1:1")  # never connects: the stand-in client answers
    remote._client = _FullRedis()
    records, handler = _capture(sb.logger.name)
    try:
        assert not any(remote.put(_key(i), CHUNK) or remote.contains(_key(i)) for i in range(20))
        assert (remote.num_errors, len(records)) == (20, 1)
        remote._client.full = False
        assert remote.put(_key(0), CHUNK)
        remote._client.full = True
        assert not remote.put(_key(1), CHUNK)
    finally:
        logging.getLogger(sb.logger.name).removeHandler(handler)
    assert (remote.num_errors, len(records), remote.num_outages, remote.is_up) == (21, 2, 0, True)
    assert "maxmemory" in records[0].getMessage()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_real_redis_over_maxmemory_logs_once(tmp_path):
    "F5 on a real server: maxmemory 1 byte + noeviction refuses every SET; one warning for all of them."
    from test_lmcache_connector import RedisServer  # tests/ is on sys.path

    server = RedisServer("--maxmemory", "1", "--maxmemory-policy", "noeviction")
    try:
        remote = RemoteBackend(server.url)
        records, handler = _capture(sb.logger.name)
        try:
            results = [remote.put(_key(i), CHUNK) for i in range(30)]
            found = [remote.contains(_key(i)) for i in range(5)]
        finally:
            logging.getLogger(sb.logger.name).removeHandler(handler)
        assert results == [False] * 30 and found == [False] * 5
        assert remote.num_errors == 30 and remote.is_up and remote.num_outages == 0
        assert len(records) == 1, [r.getMessage() for r in records]  # was 30
        remote.close()
    finally:
        server.stop()
