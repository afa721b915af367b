"""Unix socket (`ipc://`) paths under a long $TMPDIR: chapter 24d's `ipc_socket_path`, used by 29e and 45b.

A Unix socket's path has at most 107 bytes. The engine-core sockets (`TMPDIR/minivllm-<12 hex>`, 29e) and a
MessageQueue's overflow socket (`TMPDIR/minivllm-mq-<12 hex>`, 45b) were built from the temp folder unchecked:

1. A multiprocess `LLM` under a TMPDIR of 100 bytes failed at once: `ZMQError: ipc path ".../minivllm-..."
   is longer than 107 characters` from the client's ROUTER bind (a 122-byte path).
2. A `-tp 2` engine (mp executor) under a TMPDIR of 84 bytes: the engine-core sockets fit (106 bytes), the
   queue's (109) did not: "Engine core initialization failed: ZMQError ...", and the half-built queue's
   shared-memory block was left for the resource tracker. Under 100 bytes the engine failed as in 1.
3. With no usable /tmp either, the same raw ZMQError (and, for the queue, the leaked shared memory).

Now a socket that would not fit is in /tmp (one warning naming TMPDIR and the limit): the greedy tokens equal
those of a run under a short TMPDIR and no socket file is left behind; with no usable /tmp a ValueError naming
TMPDIR, its length in bytes and the limit comes before any socket, process or shared memory exists.
The tests point the fallback at a private folder in /tmp, so the files they look for are their own.
"""

import glob
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.distributed.device_communicators import shm_broadcast
from minivllm.distributed.device_communicators.shm_broadcast import MessageQueue
from minivllm.testing import make_tiny_checkpoint
from minivllm.utils import system_utils

KW = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20)
TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
PROMPTS = [
    {"prompt_token_ids": [5 + (7 * i + j) % 90 for j in range(n)]} for i, n in enumerate([3, 17, 9, 40])
]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [5, 9, 3, 7]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _greedy(ckpt, **kw):
    "Greedy token ids of a multiprocess `LLM` (engine core in a child process), shut down after."
    llm = LLM(ckpt, **KW, **kw)
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(ckpt):
    "Tokens under the short TMPDIR of the test run, for TP=1 and TP=2."
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
        mp.setenv("MINIVLLM_WORKER_MULTIPROC_METHOD", "fork")
        return {1: _greedy(ckpt), 2: _greedy(ckpt, **TP2)}


def _sockets(folder: Path) -> list[str]:
    "Socket files anywhere under `folder`."
    return [p for p in glob.glob(f"{folder}/**", recursive=True) if stat.S_ISSOCK(os.lstat(p).st_mode)]


@pytest.fixture
def long_tmpdir(monkeypatch, request):
    """(TMPDIR of `request.param` bytes, as env and as `tempfile` sees it; private fallback folder in /tmp,
    patched into `system_utils.IPC_FALLBACK_DIR`, inherited by forked children). Both removed after."""
    root = Path(tempfile.mkdtemp(prefix="ipc-long-", dir="/tmp"))
    long = root / ("d" * (request.param - len(os.fsencode(root)) - 1))
    long.mkdir()
    assert len(os.fsencode(long)) == request.param
    fallback = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(long))
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    monkeypatch.setattr(system_utils, "IPC_FALLBACK_DIR", str(fallback), raising=False)  # old code: absent
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("MINIVLLM_WORKER_MULTIPROC_METHOD", "fork")
    yield long, fallback
    monkeypatch.undo()
    shutil.rmtree(root, ignore_errors=True)  # the engine may leave torch's compile cache there
    shutil.rmtree(fallback, ignore_errors=True)


@pytest.mark.parametrize("long_tmpdir", [100], indirect=True)
def test_multiprocess_llm_under_a_100_byte_tmpdir_matches_a_short_one(ckpt, reference, long_tmpdir, caplog):
    """1. Was: `ZMQError ... longer than 107 characters` from `LLM(...)` (engine-core socket path of 122
    bytes). Now both sockets are in the fallback folder (a warning names TMPDIR and 107), the greedy tokens
    equal the short-TMPDIR run's, and after shutdown no socket file is left in either folder."""
    long, fallback = long_tmpdir
    with caplog.at_level(logging.WARNING, logger=system_utils.__name__):
        llm = LLM(ckpt, **KW)  # was: ZMQError
    client = llm.llm_engine.engine_core
    try:
        assert type(client).__name__ == "SyncMPClient" and client.proc.is_alive()
        for address in (client.input_address, client.output_address):
            assert address.startswith(f"ipc://{fallback}/minivllm-")
            assert len(os.fsencode(address.removeprefix("ipc://"))) <= 107
        assert len(_sockets(fallback)) == 2
        assert any(str(long) in r.getMessage() and "107" in r.getMessage() for r in caplog.records)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == reference[1]
    finally:
        llm.llm_engine.shutdown()
    assert not client.proc.is_alive()
    assert _sockets(fallback) == [] and _sockets(long) == []


@pytest.mark.parametrize("long_tmpdir", [84, 100], indirect=True)
def test_tp2_mp_executor_under_a_long_tmpdir_matches_a_short_one(ckpt, reference, long_tmpdir):
    """2. TP=2, mp executor, engine core in its own process. Was, at 84 bytes: "Engine core initialization
    failed: ZMQError ... minivllm-mq-..." (the queue's path was 109 bytes; the engine-core sockets' 106 fit),
    at 100 bytes the ZMQError of test 1. Now the queues' sockets (the engine's broadcast queue and each
    worker's response queue) are in the fallback folder, the engine-core sockets there only when they do
    not fit, the tokens equal the short-TMPDIR TP=2 run's, and no socket file is left behind."""
    long, fallback = long_tmpdir
    llm = LLM(ckpt, **KW, **TP2)  # was: ZMQError / RuntimeError
    client = llm.llm_engine.engine_core
    try:
        where = fallback if len(os.fsencode(long)) > 85 else long
        assert client.input_address.startswith(f"ipc://{where}/minivllm-")
        queues = [p for p in _sockets(fallback) if os.path.basename(p).startswith("minivllm-mq-")]
        assert len(queues) == 3, _sockets(fallback)  # rpc_broadcast_mq + 2 worker_response_mq
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == reference[2]
    finally:
        llm.llm_engine.shutdown()
    assert not client.proc.is_alive()
    assert _sockets(fallback) == [] and _sockets(long) == []


@pytest.mark.parametrize("long_tmpdir", [100], indirect=True)
def test_no_usable_fallback_is_a_value_error_before_anything_starts(ckpt, long_tmpdir, monkeypatch):
    """3. Was: the raw ZMQError from `bind` (a queue's shared-memory block already made, and left). Now
    `MessageQueue` and a multiprocess `LLM` raise a ValueError naming TMPDIR, its 100 bytes and the limit,
    and no shared memory or socket file is made."""
    long, fallback = long_tmpdir
    monkeypatch.setattr(system_utils, "IPC_FALLBACK_DIR", str(fallback / "absent"), raising=False)
    buffers = []  # ring buffers (shared memory) made
    real_buffer = shm_broadcast.ShmRingBuffer
    monkeypatch.setattr(
        shm_broadcast, "ShmRingBuffer", lambda *a, **k: buffers.append(real_buffer(*a, **k)) or buffers[-1]
    )
    message = rf"^TMPDIR '{long}' \(100 bytes\) is too long for the {{}} .* at most 107 bytes"
    with pytest.raises(ValueError, match=message.format("MessageQueue overflow socket")):
        MessageQueue(1)  # was: ZMQError
    with pytest.raises(ValueError, match=message.format("engine-core input / output socket")):
        LLM(ckpt, **KW)  # was: ZMQError
    for b in buffers:
        b.close()  # (the old code's leaked block)
    assert buffers == []
    assert _sockets(fallback) == [] and _sockets(long) == []
