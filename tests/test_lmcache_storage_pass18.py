"""LMCache storage tiers, pass 18B findings F1, F3, F5, F6.

F1. A disk-tier file whose unlink fails (chattr +i, EPERM/EACCES/EROFS) made eviction raise: `put` counted a
    written chunk as a failed write, and a start on a folder over its cap refused the engine. Now the file is
    skipped (its bytes still counted), logged once, and eviction goes on with the next one.
F3. A full filesystem (ENOSPC) logged one warning per chunk and never made room. Now the tier evicts its least
    recently used files and tries once more; a failure is logged once until a write succeeds again.
F5. Files with an mtime in the future were never evicted. Now such a file ranks as when it was first seen.
F6. A Redis read refused by a full noeviction server (MULTI under OOM) deleted the valid chunk. Now reads run
    without MULTI and only a bad value (WRONGTYPE, bad bytes) is deleted.
"""

import errno
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration import storage_backend as sb
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
    LocalDiskBackend,
    RemoteBackend,
    serialize_kv,
)
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import CacheEngineKey

CHUNK = torch.arange(2 * 2 * 16 * 1 * 8, dtype=torch.float32).reshape(2, 2, 16, 1, 8)
ONE = len(serialize_kv(CHUNK, CacheEngineKey("m", 1, 0, "0" * 64, "float32")))


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, f"{i:064x}", "float32")


def _capture() -> tuple[list[logging.LogRecord], logging.Handler]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    sb.logger.addHandler(handler)
    return records, handler


def _stuck_unlink(monkeypatch, stuck: set[str]) -> None:
    "Path.unlink raising EPERM for the names in `stuck` (what chattr +i does, without needing root)."
    real = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name in stuck:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)


def test_undeletable_file_is_skipped_by_eviction(tmp_path, monkeypatch):
    "F1: puts succeed, the cap holds for the deletable files, one warning, a restart over the cap starts."
    disk = LocalDiskBackend(tmp_path, max_bytes=4 * ONE, rescan_s=0)
    assert disk.put(_key(0), CHUNK)
    first = disk._file(_key(0)).name
    _stuck_unlink(monkeypatch, {first})
    records, handler = _capture()
    try:
        results = [disk.put(_key(i), CHUNK) for i in range(1, 20)]
        restarted = LocalDiskBackend(tmp_path, max_bytes=2 * ONE)  # over its cap: evicts, never raises
    finally:
        sb.logger.removeHandler(handler)
    assert results == [True] * 19 and disk.num_errors == 0
    names = {p.name for p in tmp_path.glob("*.kvchunk")}
    assert first in names and len(names) == 2, names  # the stuck one and the newest
    assert restarted.used_bytes == 2 * ONE and disk.used_bytes <= disk.max_bytes
    assert len([r for r in records if "cannot evict" in r.getMessage()]) == 2  # once per tier, not per put


def _small_filesystem(disk: LocalDiskBackend, size: int) -> None:
    "The tier's writes raise ENOSPC once its folder would hold more than `size` bytes."
    real = disk._write

    def write(f, blob):
        if sum(p.stat().st_size for p in disk.path.glob("*.kvchunk")) + len(blob) > size:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, blob)

    disk._write = write


def test_full_filesystem_evicts_and_retries(tmp_path):
    "F3: a filesystem smaller than the cap: the newest chunks are stored, the oldest evicted, no errors."
    disk = LocalDiskBackend(tmp_path, max_bytes=100 * ONE)
    _small_filesystem(disk, 2 * ONE)
    assert [disk.put(_key(i), CHUNK) for i in range(6)] == [True] * 6
    assert (disk.num_errors, disk.num_evictions, disk.used_bytes) == (0, 4, 2 * ONE)
    assert {p.name for p in tmp_path.glob("*.kvchunk")} == {disk._file(_key(i)).name for i in (4, 5)}


def test_full_filesystem_with_nothing_to_evict_logs_once(tmp_path):
    "F3: a disk full of others' data: every write fails and is counted; one warning until one succeeds."
    disk = LocalDiskBackend(tmp_path, max_bytes=100 * ONE)
    _small_filesystem(disk, 0)
    records, handler = _capture()
    try:
        assert [disk.put(_key(i), CHUNK) for i in range(5)] == [False] * 5
    finally:
        sb.logger.removeHandler(handler)
    assert disk.num_errors == 5 and len(records) == 1, [r.getMessage() for r in records]


def test_a_file_deletable_again_is_evicted_again(tmp_path, monkeypatch):
    """Pass 19: a file once undeletable was skipped for good; after `chattr -i` four such files filling the cap
    left a tier that wrote and at once evicted each new chunk. It is tried again after UNDELETABLE_RETRY_S."""
    disk = LocalDiskBackend(tmp_path, max_bytes=4 * ONE, rescan_s=0)
    for i in range(4):
        disk.put(_key(i), CHUNK)
    stuck = {disk._file(_key(i)).name for i in range(4)}
    _stuck_unlink(monkeypatch, stuck)
    clock = [1000.0]
    monkeypatch.setattr(sb.time, "monotonic", lambda: clock[0])
    disk.put(_key(10), CHUNK)  # the four refuse: the new chunk is the one evicted
    assert not disk._file(_key(10)).exists() and set(disk._undeletable) == stuck
    stuck.clear()  # chattr -i
    clock[0] += sb.UNDELETABLE_RETRY_S
    kept = []
    for i in range(11, 15):
        disk.put(_key(i), CHUNK)
        kept.append(disk._file(_key(i)).exists())
    assert kept == [True] * 4 and not disk._undeletable  # was [False] * 4: the tier stored nothing


def test_a_full_filesystem_another_engine_filled_is_rescanned(tmp_path):
    """Pass 19: engine A filled a shared filesystem; engine B's ENOSPC eviction looked only at its own
    (empty) index, and the rescan that would show it A's files ran only after a successful write: B never
    stored again. B now rescans before it gives up."""
    a = LocalDiskBackend(tmp_path, max_bytes=100 * ONE, rescan_s=3600)
    b = LocalDiskBackend(tmp_path, max_bytes=100 * ONE, rescan_s=3600)
    for tier in (a, b):
        _small_filesystem(tier, 3 * ONE)
    for i in range(3):
        assert a.put(_key(i), CHUNK)
    assert [b.put(_key(i), CHUNK) for i in range(10, 13)] == [True] * 3  # was [False] * 3
    assert b.num_errors == 0 and not any(a._file(_key(i)).exists() for i in range(3))


def test_future_mtimes_are_evicted_in_turn(tmp_path):
    "F5: another host's 4 files dated 10 minutes ahead no longer outlive this tier's own fresh chunks."
    other = LocalDiskBackend(tmp_path, max_bytes=100 * ONE)
    ahead = time.time() + 600
    for i in range(100, 104):
        other.put(_key(i), CHUNK)
        os.utime(other._file(_key(i)), (ahead, ahead))
    disk = LocalDiskBackend(tmp_path, max_bytes=5 * ONE, rescan_s=0)
    kept = []
    for i in range(8):
        disk.put(_key(i), CHUNK)
        kept.append(sum(disk._file(_key(j)).exists() for j in range(i + 1)))
    assert kept == [1, 2, 3, 4, 5, 5, 5, 5], kept  # was [1, 1, 1, ...]
    assert not any(other._file(_key(i)).exists() for i in range(100, 104))


@pytest.fixture
def full_redis():
    "A real redis-server with maxmemory 1200kb + noeviction (skipped if redis-server is not installed)."
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from test_lmcache_connector import RedisServer  # tests/ is on sys.path

    server = RedisServer("--maxmemory", "1200kb", "--maxmemory-policy", "noeviction")
    try:
        yield server.url
    finally:
        server.stop()


def test_full_redis_serves_and_keeps_its_chunks(full_redis):
    "F6: a server over maxmemory (noeviction) still serves a valid chunk, and never loses it to a read."
    import redis

    client = redis.Redis.from_url(full_redis)
    remote = RemoteBackend(full_redis)
    assert remote.put(_key(0), CHUNK)
    client.rpush(remote._name(_key(1)), b"x")  # another Redis type under our name: WRONGTYPE on a read
    with pytest.raises(redis.exceptions.ResponseError):
        for i in range(10_000):
            client.set(f"filler:{i}", b"x" * 4096)
    got = remote.get(_key(0))
    assert got is not None and torch.equal(got, CHUNK)  # was None (MULTI refused), and the chunk deleted
    assert client.exists(remote._name(_key(0))) == 1 and remote.num_errors == 0
    assert remote.get(_key(1)) is None and client.exists(remote._name(_key(1))) == 0  # a bad value: deleted
    remote.close()
    client.close()


class _RefusingRedis:
    "A client whose server answers every read with LOADING (a replica still loading its dataset)."

    class _Pipe:
        def __init__(self):
            self.n = 0

        def __getattr__(self, name):
            def queue(*args):
                self.n += 1
                return self

            return queue

        def execute(self, raise_on_error=True):
            import redis

            err = redis.exceptions.ResponseError("LOADING Redis is loading the dataset in memory")
            if raise_on_error:
                raise err
            return [err] * self.n

    def __init__(self):
        self.deleted = []

    def pipeline(self, transaction=True):
        return self._Pipe()

    def delete(self, name):
        self.deleted.append(name)
        return 1


def test_server_error_on_read_keeps_the_key():
    "F6 without a server: an error answer to a read is a counted miss; nothing is deleted."
    pytest.importorskip("redis")
    remote = RemoteBackend("redis://127.0.0.1:1")  # never connects: the stand-in answers
    remote._client = _RefusingRedis()
    assert [remote.get(_key(i)) for i in range(3)] == [None] * 3
    assert remote.num_errors == 3 and remote._client.deleted == [] and remote.is_up
