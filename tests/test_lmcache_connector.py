"""LMCacheConnectorV1 through the whole engine (tiny random checkpoints, float32, CPU), on every tier.

Greedy outputs with the connector equal those without it, cold (saving) and warm (loading), for the CPU tier
(one engine, the GPU prefix cache off so the connector is what serves the second round), the disk tier and
a real Redis server (fresh engines sharing only that tier). A warm engine computes only what the store
lacks (scheduled tokens are counted). Faults: Redis stopped between the lookup and the load, a corrupted
disk file, a CPU tier too small for the working set; keys: two processes agree, another model, dtype or
cache_salt never shares. Untrusted tiers (issue 30): forged headers, a 12-byte value, another model's chunk
and a Redis key of the wrong type are deleted misses; a full disk (simulated ENOSPC, and a real 1 MiB tmpfs
where root may mount one) leaves no temporary file. Layer-wise mode (issue 30 item 10): the same tokens as
the synchronous mode and no connector, cold and warm; a poisoned chunk is a miss; a store that stalls past
`blocking_timeout_secs` fails its loads (recomputed, same tokens) and the next step loads again.
Redis tests start a private `redis-server` on a free port.
"""

import errno
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
from minivllm.testing import make_tiny_checkpoint

BS = 16
CHUNK = 32
PROMPTS = [
    list(range(3, 3 + 75)),  # two full chunks + 11
    list(range(3, 3 + 70)),  # shares both chunks with the first prompt
    list(range(100, 100 + 40)),  # one chunk + 8
    list(range(200, 200 + 20)),  # no whole chunk: nothing stored
]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
DECODE = (PARAMS.max_tokens - 1) * len(PROMPTS)
# one chunk of the tiny llama: 2 layers x K/V x 32 tokens x 2 KV heads x 16 dims x 4 bytes
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 4


def _stored_hit(n: int, unfull: bool = False) -> int:
    "Tokens of an n-token prompt a warm store supplies (whole chunks, or blocks with unfull chunks)."
    limit = (n - 1) // BS * BS
    return limit if unfull else min(n // CHUNK * CHUNK, limit)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    "A private redis-server on 127.0.0.1 (no persistence); `stop()` kills it."

    def __init__(self, *extra: str):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            *extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a SIGSTOPped server handles SIGTERM only once thawed
            self.proc.terminate()
            self.proc.wait(timeout=10)


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; CI installs it)")


@pytest.fixture
def redis_server():
    _need_redis()
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def _kvt(**settings) -> KVTransferConfig:
    extra = {"chunk_size": CHUNK, "local_cpu": False, **settings}
    return KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config=extra
    )


class Engine:
    "An LLM whose scheduled tokens are counted; `.store` is its worker connector's StorageManager."

    def __init__(self, ckpt, kv_transfer_config=None, dtype="float32", on_schedule=None, **kw):
        self.llm = LLM(
            ckpt,
            **kw,
            dtype=dtype,
            max_model_len=256,
            block_size=BS,
            enable_prefix_caching=False,
            kv_transfer_config=kv_transfer_config,
        )
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        self.scheduled = 0
        schedule = scheduler.schedule

        def counting_schedule():
            so = schedule()
            self.scheduled += so.total_num_scheduled_tokens
            if on_schedule is not None:
                on_schedule(so)
            return so

        scheduler.schedule = counting_schedule
        # the worker's connector (in this process with the in-process executor; None with worker processes)
        self.connector = get_kv_transfer_group_or_none() if kv_transfer_config is not None else None

    @property
    def store(self):
        return self.connector.storage

    def generate(self, prompts=PROMPTS, **prompt_fields):
        "Greedy token ids per prompt; returns (tokens, tokens scheduled by this call)."
        before = self.scheduled
        outs = self.llm.generate(
            [{"prompt_token_ids": p, **prompt_fields} for p in prompts], PARAMS, use_tqdm=False
        )
        return [o.outputs[0].token_ids for o in outs], self.scheduled - before

    def shutdown(self):
        self.llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(ckpt):
    engine = Engine(ckpt)
    try:
        tokens, scheduled = engine.generate()
    finally:
        engine.shutdown()
    assert scheduled == sum(map(len, PROMPTS)) + DECODE  # no prefix cache: everything computed
    return tokens


def _run(ckpt, kvt, prompts=PROMPTS, **kw):
    engine = Engine(ckpt, kvt, **kw)
    try:
        tokens, scheduled = engine.generate(prompts)
        stats = engine.store.stats()
    finally:
        engine.shutdown()  # flushes the write-back queue: disk and Redis hold everything
    return tokens, scheduled, stats


@pytest.mark.parametrize("layerwise", [False, True], ids=["synchronous", "layerwise"])
def test_cpu_tier_cold_then_warm_in_one_engine(ckpt, reference, layerwise):
    "Both modes (loads before the forward, or layer by layer beside it) give the no-connector tokens."
    engine = Engine(ckpt, _kvt(local_cpu=True, max_local_cpu_size=0.01, use_layerwise=layerwise))
    assert engine.connector._worker.layerwise is layerwise
    try:
        cold, cold_scheduled = engine.generate()
        warm, warm_scheduled = engine.generate()
        stats = engine.store.stats()
    finally:
        engine.shutdown()
    assert cold == reference and warm == reference
    assert cold_scheduled == sum(map(len, PROMPTS)) + DECODE  # one step prefills all four: no hit yet
    hits = sum(_stored_hit(len(p)) for p in PROMPTS)
    assert warm_scheduled == sum(map(len, PROMPTS)) - hits + DECODE
    assert stats["hits"]["LocalCPUBackend"] == hits // CHUNK and stats["errors"] == 0


def test_worker_process_answers_the_schedulers_lookups(ckpt, reference):
    "With worker processes the CPU tier lives in another process: lookups cross it over the ipc:// socket."
    engine = Engine(ckpt, _kvt(local_cpu=True, max_local_cpu_size=0.01), distributed_executor_backend="mp")
    try:
        cold, _ = engine.generate()
        warm, warm_scheduled = engine.generate()
    finally:
        engine.shutdown()
    assert cold == reference and warm == reference
    assert warm_scheduled == sum(map(len, PROMPTS)) - sum(_stored_hit(len(p)) for p in PROMPTS) + DECODE


@pytest.mark.parametrize("tier", ["disk", "redis", "all"])
def test_fresh_engine_loads_from_tier(ckpt, reference, tier, tmp_path, request):
    settings = {}
    if tier in ("disk", "all"):
        settings.update(local_disk=f"file://{tmp_path}", max_local_disk_size=0.01)
    if tier in ("redis", "all"):
        settings.update(remote_url=request.getfixturevalue("redis_server").url)
    if tier == "all":
        settings.update(local_cpu=True, max_local_cpu_size=0.01)
    cold, _, _ = _run(ckpt, _kvt(**settings))
    warm, warm_scheduled, stats = _run(ckpt, _kvt(**settings))  # a fresh engine: only the shared tiers
    assert cold == reference and warm == reference
    hits = sum(_stored_hit(len(p)) for p in PROMPTS)
    assert warm_scheduled == sum(map(len, PROMPTS)) - hits + DECODE  # the stored chunks were not recomputed
    if tier == "all":  # prompt 1's chunks come from disk and are promoted: prompt 2 reads them from memory
        assert stats["hits"] == {"LocalCPUBackend": 2, "LocalDiskBackend": 3, "RemoteBackend": 0}
    else:
        assert stats["hits"] == {"RemoteBackend" if tier == "redis" else "LocalDiskBackend": hits // CHUNK}
    assert stats["errors"] == 0


def test_save_unfull_chunk_serves_the_same_prompt_to_the_last_block(ckpt, reference, tmp_path):
    kvt = dict(local_disk=str(tmp_path), max_local_disk_size=0.01, save_unfull_chunk=True)
    cold, _, _ = _run(ckpt, _kvt(**kvt))
    warm, warm_scheduled, _ = _run(ckpt, _kvt(**kvt))
    assert cold == reference and warm == reference
    hits = [_stored_hit(len(p), unfull=True) for p in PROMPTS]
    assert hits == [64, 64, 32, 16]
    assert warm_scheduled == sum(map(len, PROMPTS)) - sum(hits) + DECODE


def test_redis_stopped_mid_run_recomputes(ckpt, reference, redis_server):
    _run(ckpt, _kvt(remote_url=redis_server.url))

    def stop_after_lookup(so):
        if so.kv_connector_metadata.loads:  # looked up while Redis was up; the load comes next
            redis_server.stop()

    t0 = time.monotonic()
    tokens, scheduled, stats = _run(ckpt, _kvt(remote_url=redis_server.url), on_schedule=stop_after_lookup)
    assert tokens == reference  # every request completed, by recomputing
    assert stats["errors"] >= 1 and stats["hits"]["RemoteBackend"] == 0
    assert scheduled >= sum(map(len, PROMPTS)) + DECODE - 64  # nothing was loaded (a failed load is redone)
    assert time.monotonic() - t0 < 60  # generous: it must not hang on timeouts


def _remote_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "RemoteBackend" in r.getMessage()
    ]


def _wait_up(remote, timeout_s: float = 10.0) -> bool:
    "Whether the remote tier's probe saw the server answer within `timeout_s` (a hang guard)."
    deadline = time.monotonic() + timeout_s
    while not remote.is_up and time.monotonic() < deadline:
        time.sleep(0.05)
    return remote.is_up


def test_stalled_redis_is_one_outage_and_the_engine_keeps_serving(ckpt, reference, redis_server, caplog):
    """Issue 30 (second pass): a stalled Redis (SIGSTOP: it accepts connections and never answers) made every
    lookup wait out the socket timeout once per second of back-off, with a warning each time, on the
    scheduler's path. Now the first timeout marks the tier down (one warning) and every later call is a
    miss at once until the background probe sees the server again; the engine serves every request meanwhile
    (the no-connector tokens), and loads from Redis again once it is thawed."""
    _run(ckpt, _kvt(remote_url=redis_server.url))  # stores the chunks in Redis
    engine = Engine(ckpt, _kvt(remote_url=redis_server.url))
    remote = engine.store.tiers[0]
    hits = sum(_stored_hit(len(p)) for p in PROMPTS)
    try:
        redis_server.proc.send_signal(signal.SIGSTOP)
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                tokens, scheduled = engine.generate()
                assert tokens == reference and scheduled == sum(map(len, PROMPTS)) + DECODE  # all computed
                time.sleep(1.5)  # past the old back-off of 1 s: it paid the timeout again after it
        assert len(_remote_warnings(caplog)) == 1, _remote_warnings(caplog)  # before: one per back-off
        assert remote.num_outages == 1 and not remote.is_up
        redis_server.proc.send_signal(signal.SIGCONT)
        assert _wait_up(remote), "the probe never saw the server again"
        tokens, scheduled = engine.generate()
        assert tokens == reference and scheduled == sum(map(len, PROMPTS)) - hits + DECODE  # loaded again
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
        engine.shutdown()


def test_redis_password_in_the_url(ckpt, reference, caplog):
    """Issue 30 item 5: a Redis with `requirepass`. The URL's password reaches the server (a fresh engine
    loads what another stored); without it every call is a miss (one outage) and the tokens are the same;
    no log line shows the password."""
    _need_redis()
    server = RedisServer("--requirepass", "s3cret")
    hits = sum(_stored_hit(len(p)) for p in PROMPTS)
    with_password = server.url.replace("redis://", "redis://:s3cret@")
    try:
        with caplog.at_level(logging.INFO):
            _run(ckpt, _kvt(remote_url=with_password))
            tokens, scheduled, stats = _run(ckpt, _kvt(remote_url=with_password))
            assert (
                tokens == reference
                and stats["hits"]["RemoteBackend"] == hits // CHUNK
                and stats["errors"] == 0
            )
            engine = Engine(ckpt, _kvt(remote_url=server.url))
            try:
                tokens, scheduled = engine.generate()
                remote = engine.store.tiers[0]
                assert tokens == reference and scheduled == sum(map(len, PROMPTS)) + DECODE
                assert remote.num_outages == 1 and not remote.is_up  # NOAUTH: down, and probed
            finally:
                engine.shutdown()
        assert "s3cret" not in caplog.text
        assert any("authenticat" in w.lower() for w in _remote_warnings(caplog))
    finally:
        server.stop()


def test_corrupted_disk_file_is_a_miss(ckpt, reference, tmp_path):
    kvt = dict(local_disk=str(tmp_path), max_local_disk_size=0.01)
    _run(ckpt, _kvt(**kvt), prompts=PROMPTS[:1])
    files = sorted(tmp_path.glob("*.kvchunk"))
    assert len(files) == 2
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0x40  # one bit in the payload: only the checksum can tell
        f.write_bytes(bytes(raw))
    tokens, scheduled, stats = _run(ckpt, _kvt(**kvt), prompts=PROMPTS[:1])
    assert tokens == reference[:1]
    assert stats["errors"] >= 1 and stats["hits"]["LocalDiskBackend"] == 0
    # the first step ran only the tail after the granted 64 tokens; its result was dropped and all recomputed
    assert scheduled == (len(PROMPTS[0]) - 64) + len(PROMPTS[0]) + PARAMS.max_tokens - 1


def test_full_cpu_tier_evicts_lru_by_bytes(ckpt, reference):
    limit = 2.5 * CHUNK_BYTES  # room for two chunks
    engine = Engine(ckpt, _kvt(local_cpu=True, max_local_cpu_size=limit / (1 << 30)))
    try:
        cpu = engine.store.tiers[0]
        tokens, _ = engine.generate([PROMPTS[2], PROMPTS[0]])  # 3 chunks: the first prompt's is evicted
        assert cpu.used_bytes <= cpu.max_bytes and cpu.num_evictions == 1 and len(cpu) == 2
        assert tokens == [reference[2], reference[0]]
        _, scheduled = engine.generate([PROMPTS[2]])  # evicted: computed again (and stored again)
        assert scheduled == len(PROMPTS[2]) + PARAMS.max_tokens - 1
        _, scheduled = engine.generate([PROMPTS[2]])
        assert scheduled == len(PROMPTS[2]) - CHUNK + PARAMS.max_tokens - 1
        assert cpu.used_bytes <= cpu.max_bytes and cpu.num_evictions == 2
    finally:
        engine.shutdown()


_KEYS_SCRIPT = """
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import (
    ChunkedTokenDatabase, LMCacheEngineMetadata)
db = ChunkedTokenDatabase(32, save_unfull_chunk=True, block_size=16)
meta = LMCacheEngineMetadata("org/model", 1, 0, "float32")
print(*[k.to_string() for _, _, k in db.process_tokens(list(range(100)), meta, cache_salt="s")])
"""


def test_two_processes_agree_on_keys():
    outs = []
    for seed in ("0", "1234"):  # even different hash seeds: the chain has a fixed root
        run = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        )
        outs.append(run.stdout.split())
    assert outs[0] == outs[1] and len(outs[0]) == 3  # three full chunks; the 4-token tail is under a block


def test_other_model_dtype_or_salt_never_share(ckpt, reference, tmp_path, tmp_path_factory):
    kvt = dict(local_disk=str(tmp_path), max_local_disk_size=0.01)
    full = len(PROMPTS[0]) + PARAMS.max_tokens - 1
    _run(ckpt, _kvt(**kvt), prompts=PROMPTS[:1])
    engine = Engine(ckpt, _kvt(**kvt))
    try:
        tokens, scheduled = engine.generate(PROMPTS[:1], cache_salt="tenant-b")
        assert tokens == reference[:1] and scheduled == full  # another tenant's salt: nothing shared
        _, scheduled = engine.generate(PROMPTS[:1])
        assert scheduled == full - 64  # the unsalted prompt does share (the store works)
    finally:
        engine.shutdown()
    _, scheduled, _ = _run(ckpt, _kvt(**kvt), prompts=PROMPTS[:1], dtype="bfloat16")
    assert scheduled == full  # another KV dtype
    other = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("other"), seed=1)
    other_ref = Engine(other)
    try:
        ref_tokens, _ = other_ref.generate(PROMPTS[:1])
    finally:
        other_ref.shutdown()
    tokens, scheduled, _ = _run(other, _kvt(**kvt), prompts=PROMPTS[:1])
    assert tokens == ref_tokens and scheduled == full  # another model's chunks never match


# ---- issue 30: a tier's bytes are untrusted; a full disk leaks nothing ----

from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration import (  # noqa: E402
    storage_backend as sb,
)


def _forge(header, payload: bytes = b"") -> bytes:
    "A stored chunk's framing around any header (bytes or a JSON-able object) and payload."
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return sb._MAGIC + struct.pack("<I", len(head)) + head + payload


def _split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<I", blob[6:10])
    return json.loads(blob[10 : 10 + n]), blob[10 + n :]


def _poisons(key: str | None = None) -> list[bytes]:
    """Three entries a chunk's checksum cannot catch: a `[]` header (12 bytes in all), a dtype of 'nn', and a
    well-formed chunk of another model's layout (1 layer, head size 8), its header naming `key` (the
    `key_digest` of where it is planted, so that the tier reads it and the connector refuses its layout)."""
    header, payload = _split(sb.serialize_kv(torch.zeros(2, 2, CHUNK, 2, 16)))
    other_header, other_payload = _split(sb.serialize_kv(torch.ones(1, 2, CHUNK, 2, 8)))
    other_model = _forge(dict(other_header, key=key) if key else other_header, other_payload)
    return [_forge(b"[]"), _forge(dict(header, dtype="nn"), payload), other_model]


def _is_valid_or_gone(blob: bytes | None) -> bool:
    if blob is None:
        return True
    kv = sb.deserialize_kv(blob)
    return tuple(kv.shape) == (2, 2, CHUNK, 2, 16)


@pytest.mark.parametrize("layerwise", [False, True], ids=["synchronous", "layerwise"])
def test_poisoned_disk_entries_are_deleted_misses(ckpt, reference, tmp_path, layerwise):
    kvt = dict(local_disk=str(tmp_path), max_local_disk_size=0.01, use_layerwise=layerwise)
    _run(ckpt, _kvt(**kvt))
    files = sorted(tmp_path.glob("*.kvchunk"))
    assert len(files) == 3  # prompt 0's two chunks (prompt 1 shares them), prompt 2's one
    for f, poison in zip(files, _poisons(files[2].stem)):  # a disk file's name is its key's key_digest
        f.write_bytes(poison)
    assert len(_poisons()[0]) == 12
    engine = Engine(ckpt, _kvt(**kvt))
    try:
        tokens, _ = engine.generate()
        assert tokens == reference  # every request recomputed what it could not load
        stats = engine.store.stats()
        # the other model's chunk is read by the tier (a hit there) and refused by the connector
        assert stats["errors"] == 3 and stats["hits"]["LocalDiskBackend"] == 1
        assert engine.store.num_invalid == 1
        assert all(_is_valid_or_gone(f.read_bytes() if f.exists() else None) for f in files)
        assert engine.generate()[0] == reference  # and the engine keeps serving
    finally:
        engine.shutdown()
    tokens, _, stats = _run(ckpt, _kvt(**kvt))  # a restart does not meet them again
    assert tokens == reference and stats["errors"] == 0


def test_poisoned_redis_values_are_deleted_misses(ckpt, reference, redis_server):
    import redis

    _run(ckpt, _kvt(remote_url=redis_server.url))
    client = redis.Redis.from_url(redis_server.url)
    try:
        names = sorted(client.keys("lmcache:*"))
        assert len(names) == 3
        twelve, bad_dtype, _ = _poisons()
        client.set(names[0], twelve)  # the 12-byte value of the issue
        client.set(names[1], bad_dtype)
        client.delete(names[2])
        client.rpush(names[2], b"a list, not a string")  # WRONGTYPE on GET
        tokens, _, stats = _run(ckpt, _kvt(remote_url=redis_server.url))
        assert tokens == reference
        assert stats["errors"] == 3 and stats["hits"]["RemoteBackend"] == 0
        for name in names:
            assert client.type(name) in (b"none", b"string") and _is_valid_or_gone(client.get(name))
        tokens, _, stats = _run(ckpt, _kvt(remote_url=redis_server.url))
        assert tokens == reference and stats["errors"] == 0
    finally:
        client.close()


def _tmp_files(path) -> list:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp"))


def _full_disk_run(ckpt, reference, path):
    "An engine whose disk tier cannot write: same tokens, failed writes counted, no temporary left."
    stale = path / "tmpcrashed.tmp"  # a crashed writer's, an hour old: the start-up rebuild sweeps it
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    engine = Engine(ckpt, _kvt(local_disk=str(path), max_local_disk_size=0.01))
    try:
        assert not stale.exists()
        tokens, _ = engine.generate()
        assert engine.store.flush()
        stats = engine.store.stats()
    finally:
        engine.shutdown()
    assert tokens == reference
    assert stats["errors"] >= 1
    assert _tmp_files(path) == []
    return stats


def test_full_disk_leaves_no_temporary_files(ckpt, reference, tmp_path, monkeypatch):
    "ENOSPC after half a chunk reached the file, on every write into the tier's folder (any filesystem)."
    real = os.fdopen

    class HalfThenFull:
        def __init__(self, fd, mode="r", *a, **kw):
            self.f = real(fd, mode, *a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, b):
            self.f.write(b[: len(b) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd, *a, **kw):
        in_tier = os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
        return HalfThenFull(fd, *a, **kw) if in_tier else real(fd, *a, **kw)

    monkeypatch.setattr(os, "fdopen", fdopen)
    stats = _full_disk_run(ckpt, reference, tmp_path)
    assert stats["errors"] >= 3  # every write failed (shared chunks were tried again); none left a file
    assert sorted(tmp_path.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    "A 1 MiB tmpfs, nearly filled (root only; skipped where mount is not allowed)."
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.decode().strip()}")
    try:
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        (mnt / "filler").write_bytes(b"\0" * (free - CHUNK_BYTES // 2))  # room for half a chunk
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_leaves_no_temporary_files(ckpt, reference, small_tmpfs):
    _full_disk_run(ckpt, reference, small_tmpfs)
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler"]


def test_layerwise_stalled_store_times_out_and_recomputes(ckpt, reference):
    "A store read hanging past blocking_timeout_secs: the step recomputes, nothing hangs, later loads work."
    import threading

    kvt = _kvt(local_cpu=True, max_local_cpu_size=0.01, use_layerwise=True, blocking_timeout_secs=0.2)
    engine = Engine(ckpt, kvt)
    release = threading.Event()
    try:
        assert engine.generate()[0] == reference  # cold: stores the chunks
        store = engine.store
        get = store.get

        def stalled_get(key):
            release.wait(30)  # far past the 0.2 s timeout; released below
            return get(key)

        store.get = stalled_get
        tokens, scheduled = engine.generate()
        assert tokens == reference
        # the loads failed: every prompt token was computed at least once (a load would have saved `hits`)
        assert scheduled >= sum(map(len, PROMPTS)) + DECODE
        hits = sum(_stored_hit(len(p)) for p in PROMPTS)
        release.set()
        store.get = get
        warm, warm_scheduled = engine.generate()
        assert warm == reference and warm_scheduled == sum(map(len, PROMPTS)) - hits + DECODE
    finally:
        release.set()
        engine.shutdown()
