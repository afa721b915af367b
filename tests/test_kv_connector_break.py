"""A try-to-break pass on the KV connectors (issue 30's "fresh helper"): what a client or a peer can send
that must neither kill an engine nor hang its requests.

1. P2pZmqConnector consumer: a peer (any host:port a client names in `kv_transfer_params`) that answers a
   READ with a deeply nested JSON header made `json.loads` raise `RecursionError` (not a `ValueError`) on the
   pull thread; the thread died, and every later pull of that engine waited forever. The bad request must be
   recomputed, and a good pull after it must still be transferred.
2. P2pZmqConnector producer: a READ naming the request's blocks 1000 times was answered with 1000x the bytes
   (a million repeats: a copy that size per layer, enough to run the producer out of memory).
"""

import errno
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from test_kv_connector_pd import _count_scheduled  # the same counter (tests/ is on sys.path)

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port

PROMPT = list(range(5, 5 + 37))
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _full_disk_save_file(attempts: list):
    "A safetensors `save_file` on a full disk: part of the file is written, then ENOSPC; logs each filename."

    def full_disk(tensors, filename, *a, **kw):
        attempts.append(filename)
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)  # part of the file reached the disk, then it filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    return full_disk


def _llm(ckpt, kvt=None):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt)


def _sp(params=None, max_tokens=MAX_TOKENS):
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _run_until(llm, request_id: str, finished: dict, timeout: float = 40.0) -> None:
    "Step `llm` until `request_id` finished; fails (never hangs) after `timeout` seconds."
    t0 = time.monotonic()
    while request_id not in finished:
        assert time.monotonic() - t0 < timeout, f"{request_id} did not finish within {timeout} s"
        finished.update({out.request_id: out for out in llm.llm_engine.step() if out.finished})


class _EvilPeer:
    "A ROUTER on 127.0.0.1 that answers every message with `reply` frames (after the identity)."

    def __init__(self, port: int, reply: list[bytes]):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.reply = reply
        self.num_answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                self.sock.send_multipart([frames[0], *self.reply])
                self.num_answered += 1

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(0)
        self.ctx.term()


def test_a_nested_json_answer_does_not_stop_later_pulls(ckpt):
    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    port = get_open_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    cons = _llm(
        ckpt,
        {
            "kv_connector": "P2pZmqConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"transfer_timeout_s": 5},
        },
    )
    worker = get_kv_transfer_group_or_none().connector_worker  # the consumer's (built last)
    evil_port = get_open_port()
    evil = _EvilPeer(evil_port, [b"OK", b"[" * 100_000])  # json.loads: RecursionError, not ValueError
    try:
        first = prod.generate(
            [{"prompt_token_ids": PROMPT}], _sp({"do_remote_decode": True}, 1), use_tqdm=False
        )[0]
        prod.llm_engine.step()  # registers the blocks with the producer's server
        good = first.kv_transfer_params
        bad = dict(good, remote_request_id="someone-else", remote_port=evil_port)
        finished = {}
        counts = _count_scheduled(cons)
        cons.llm_engine.add_request("bad", {"prompt_token_ids": PROMPT}, _sp(bad))
        _run_until(cons, "bad", finished)
        assert finished["bad"].outputs[0].token_ids == want  # recomputed
        assert sum(counts) == len(PROMPT) + MAX_TOKENS - 1
        assert evil.num_answered >= 1  # the poisoned answer was really read
        assert worker._puller is not None and worker._puller.is_alive()  # before: died with the bad pull
        counts.clear()
        cons.llm_engine.add_request("good", {"prompt_token_ids": PROMPT}, _sp(good))
        _run_until(cons, "good", finished)  # before: waited forever (nobody ran the pull)
        assert finished["good"].outputs[0].token_ids == want
        assert sum(counts) == 1 + MAX_TOKENS - 1  # transferred, not recomputed
    finally:
        evil.close()
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()


def test_producer_refuses_repeated_block_ids(ckpt):
    """4. Anyone who can reach a producer's kv_port and holds one request's parameters (its client does) could
    ask for its blocks repeated a million times: the producer gathered them all into one reply (a copy that
    size per layer), enough to run it out of memory. A READ naming a block twice is refused."""
    port = get_open_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        first = prod.generate(
            [{"prompt_token_ids": PROMPT}], _sp({"do_remote_decode": True}, 1), use_tqdm=False
        )[0]
        prod.llm_engine.step()  # registers the blocks with the producer's server
        params = first.kv_transfer_params
        sock.connect(f"tcp://127.0.0.1:{port}")

        def read(block_ids):
            msg = {"req_id": params["remote_request_id"], "tag": "t", "block_ids": block_ids,
                   "digest": params["prompt_digest"]}  # fmt: skip
            sock.send_multipart([b"READ", json.dumps(msg).encode()])
            assert sock.poll(10_000), "the producer did not answer"
            return sock.recv_multipart()

        ok = read(params["remote_block_ids"])
        assert ok[0] == b"OK" and len(ok) == 2 + len(json.loads(ok[1])["layers"])  # the legitimate read
        refused = read(params["remote_block_ids"] * 1000)
        assert refused[0] == b"ERROR" and b"none repeated" in refused[1]  # before: OK, 1000x the bytes
    finally:
        sock.close(0)
        ctx.term()
        prod.llm_engine.shutdown()


# ---- ExampleConnector: a full disk ----


def test_example_connector_full_disk_keeps_serving(ckpt, tmp_path, monkeypatch):
    """3. ExampleConnector on a full disk: `save_file` raising ENOSPC in `wait_for_save` propagated out of the
    forward and killed the engine, leaving its half-written `tmp*.tmp`. A failed save is logged and skipped:
    the same tokens, nothing left in the folder."""
    from minivllm.distributed.kv_transfer.kv_connector.v1 import example_connector

    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    attempts = []
    full_disk = _full_disk_save_file(attempts)
    monkeypatch.setattr(example_connector, "save_file", full_disk)
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = _llm(ckpt, kvt)
    try:
        for _ in range(2):  # the second run finds nothing stored and tries again
            out = llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
    finally:
        llm.llm_engine.shutdown()
    assert len(attempts) >= 2  # the saves really were tried, and failed
    assert sorted(tmp_path.iterdir()) == []  # no temporary and no partial file left


def test_example_connector_broadcastable_file_is_not_served(ckpt, tmp_path):
    """4. ExampleConnector: a stored file whose tensors have a shape that broadcasts into a block (here one
    element per layer) passed `copy_` without an error, so the block was served as that one value repeated
    (silently wrong tokens). A tensor whose shape or dtype is not the block's is damaged: recomputed."""
    import torch
    from safetensors.torch import load_file, save_file

    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import safetensors_digest

    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    for poisoned in (False, True):
        if poisoned:
            for f in tmp_path.glob("*.safetensors"):
                broadcastable = {name: torch.full((1, 1, 1, 1), 1e4) for name in load_file(f)}
                meta = {"sha256": safetensors_digest(broadcastable), "file": f.name}  # intact, at its key
                save_file(broadcastable, f, metadata=meta)
        llm = _llm(ckpt, kvt)
        counts = _count_scheduled(llm)
        try:
            out = llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0]
        finally:
            llm.llm_engine.shutdown()
        assert out.outputs[0].token_ids == want
        if poisoned:  # every stored block was refused and recomputed
            assert sum(counts) > len(PROMPT) - len(PROMPT) // 16 * 16 + MAX_TOKENS - 1


def _flip_a_bit(f) -> None:
    "Flip one bit near the end of file `f` (its last tensor's values): the file stays well-formed."
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))


def test_example_connector_damaged_file_is_a_deleted_miss(ckpt, tmp_path):
    """11. ExampleConnector kept no checksum: a file with one bit flipped on the disk (still a valid
    safetensors file of the right shapes) was loaded as KV nobody computed, and a truncated one stayed to
    fail every later request. Each file carries a sha256 of its tensors; a damaged or truncated file is a
    miss (recomputed, the same tokens) and is deleted; the recomputation stores it again, and the next
    engine loads it."""
    from safetensors import safe_open

    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = _llm(ckpt, kvt)
    llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)  # stores PROMPT's two full blocks
    llm.llm_engine.shutdown()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 2
    _flip_a_bit(files[0])
    files[1].write_bytes(files[1].read_bytes()[:-100])  # cut short
    for damaged in (True, False):
        llm = _llm(ckpt, kvt)
        counts = _count_scheduled(llm)
        try:
            out = llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0]
        finally:
            llm.llm_engine.shutdown()
        assert out.outputs[0].token_ids == want
        loaded = sum(counts) == len(PROMPT) - 32 + MAX_TOKENS - 1  # only the tail and the decode computed
        assert loaded != damaged  # before: the flipped file was loaded
    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import safetensors_digest

    for f in files:  # each was deleted and stored again: intact now
        with safe_open(f, "pt") as st:
            assert st.metadata()["sha256"] == safetensors_digest({k: st.get_tensor(k) for k in st.keys()})


# ---- ECExampleConnector (images): a full disk ----


def test_ec_connector_full_disk_keeps_serving(tmp_path_factory, tmp_path, monkeypatch):
    """5. ECExampleConnector on a full disk: `save_file` raising ENOSPC in `save_caches` left the encoder step
    and killed the engine. A failed save is logged and skipped: the plain tokens, no temporary file left."""
    import numpy as np
    from PIL import Image

    from minivllm.distributed.ec_transfer.ec_connector import example_connector as ec_example

    g3 = make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))
    img = Image.fromarray(np.random.default_rng(3).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    req = {"prompt": "<bos>Look at <start_of_image> and say", "multi_modal_data": {"image": [img]}}
    plain = LLM(g3, dtype="float32", block_size=4)
    want = plain.generate([req], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    plain.llm_engine.shutdown()
    attempts = []
    full_disk = _full_disk_save_file(attempts)
    monkeypatch.setattr(ec_example, "save_file", full_disk)
    ect = {"ec_connector": "ECExampleConnector", "ec_role": "ec_both",
           "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = LLM(g3, dtype="float32", block_size=4, ec_transfer_config=ect)
    try:
        out = llm.generate([req], _sp(), use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert out.outputs[0].token_ids == want
    assert len(attempts) == 1  # the save really was tried, and failed
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no temporary or partial file left


# ---- a tier entry that is not a regular file (a FIFO) ----


def _unblock(path) -> None:
    "Open `path` (a FIFO) for writing and close it, so a reader blocked on it sees end-of-file."
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # nobody is reading it (the fix): nothing to release
        pass


def _returns(fn, path) -> bool:
    "Whether fn() returns within 10 s (a hang guard, not a timing claim); a blocked reader is released."
    th = threading.Thread(target=fn, daemon=True)
    th.start()
    th.join(10)
    blocked = th.is_alive()
    if blocked:
        _unblock(path)
        th.join(10)
    return not blocked


def test_lmcache_disk_fifo_is_a_miss_not_a_hang(tmp_path):
    """6. LMCache's disk tier: a FIFO where a chunk file should be (anyone who can write the folder can make
    one) made `get` block in `read_bytes()` until someone wrote to it: the loading forward (the engine) hung.
    Only a regular file is read; anything else is a counted, deleted miss."""
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
        LocalDiskBackend,
    )
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import CacheEngineKey

    disk = LocalDiskBackend(tmp_path, 1 << 20)
    key = CacheEngineKey("m", 1, 0, "abc", "float32")
    os.mkfifo(disk._file(key))
    got = []
    assert _returns(lambda: got.append(disk.get(key)), disk._file(key)), "get blocked on a FIFO"
    assert got == [None] and disk.num_errors == 1
    assert not disk._file(key).exists()  # deleted


def test_example_connector_fifo_is_recomputed_not_a_hang(ckpt, tmp_path):
    """7. ExampleConnector: a FIFO in place of a stored block's file counted as stored, and `load_file` waited
    on it for a writer: the engine hung. Only regular files are loaded; the block is recomputed."""
    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = _llm(ckpt, kvt)
    llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)  # stores the prompt's blocks
    llm.llm_engine.shutdown()
    stored = sorted(tmp_path.glob("*.safetensors"))
    assert stored
    for f in stored:
        f.unlink()
        os.mkfifo(f)
    llm = _llm(ckpt, kvt)
    try:
        got = []
        run = lambda: got.append(llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0])  # noqa: E731
        assert _returns(run, stored[0]), "the engine blocked on a FIFO"
        for f in stored[1:]:
            _unblock(f)
        assert got[0].outputs[0].token_ids == want
    finally:
        for f in stored:
            _unblock(f)
        llm.llm_engine.shutdown()


def test_ec_connector_fifo_is_encoded_not_a_hang(tmp_path_factory, tmp_path):
    """8. ECExampleConnector: a FIFO in place of an encoder output's file made `load_file` wait for a writer:
    the engine hung. Only a regular file is loaded; the image is encoded instead (the plain tokens)."""
    import numpy as np
    from PIL import Image

    g3 = make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))
    img = Image.fromarray(np.random.default_rng(4).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    req = {"prompt": "<bos>Look at <start_of_image> and say", "multi_modal_data": {"image": [img]}}
    ect = {"ec_connector": "ECExampleConnector", "ec_role": "ec_both",
           "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = LLM(g3, dtype="float32", block_size=4, ec_transfer_config=ect)
    want = llm.generate([req], _sp(), use_tqdm=False)[0].outputs[0].token_ids  # encodes and stores
    llm.llm_engine.shutdown()
    (stored,) = tmp_path.rglob("encoder_cache.safetensors")
    stored.unlink()
    os.mkfifo(stored)
    llm = LLM(g3, dtype="float32", block_size=4, ec_transfer_config=ect)
    try:
        got = []
        run = lambda: got.append(llm.generate([req], _sp(), use_tqdm=False)[0])  # noqa: E731
        assert _returns(run, stored), "the engine blocked on a FIFO"
        assert got[0].outputs[0].token_ids == want
    finally:
        _unblock(stored)
        llm.llm_engine.shutdown()


# ---- P2pZmqConnector consumer: what a peer may send (second pass) ----


def _p2p_consumer(ckpt, transfer_timeout_s: float):
    "A consumer LLM and its worker connector (this process's, built last)."
    kvt = {
        "kv_connector": "P2pZmqConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"transfer_timeout_s": transfer_timeout_s},
    }
    cons = _llm(ckpt, kvt)
    return cons, get_kv_transfer_group_or_none().connector_worker


def _pull_params(port: int, remote_request_id: str = "r") -> dict:
    "kv_transfer_params pointing a consumer at `port` for PROMPT's three blocks."
    return {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2, 3],
        "remote_request_id": remote_request_id,
        "remote_engine_id": "evil",
        "remote_host": "127.0.0.1",
        "remote_port": port,
    }


def _connector_stats(llm) -> dict:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_connector_stats or {}


def test_an_unreadable_answer_is_a_miss_at_once(ckpt):
    """9. An answer whose header cannot be read (not JSON) names no pull, and was dropped: its pull waited for
    transfer_timeout_s before it was recomputed (here an hour; before, `_run_until` gave up after 40 s). It
    fails the peer's pulls at once, counted in p2p_bad_answers. Headers over 64 KiB (nested 100,000 deep,
    padded) are refused before they are stored: the tiny model's frames are bounded at 64 KiB."""
    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    cons, worker = _p2p_consumer(ckpt, transfer_timeout_s=3600)
    port = get_open_port()
    evil = _EvilPeer(port, [])
    answers = [
        [b"OK", b"not json"],  # an unreadable header: the peer's pulls fail
        [b"OK", b"[" * 100_000],  # over 64 KiB: the frame bound drops the peer before it is stored
        [b"OK", json.dumps({"tag": "x", "pad": "x" * 70_000}).encode()],  # likewise
    ]
    try:
        finished = {}
        for i, answer in enumerate(answers):
            evil.reply = answer
            cons.llm_engine.add_request(f"bad{i}", {"prompt_token_ids": PROMPT}, _sp(_pull_params(port)))
            _run_until(cons, f"bad{i}", finished)
            assert finished[f"bad{i}"].outputs[0].token_ids == want  # recomputed
        assert evil.num_answered == len(answers)
        assert worker._puller.is_alive()
        stats = _connector_stats(cons)
        assert stats.get("p2p_bad_answers") == 1 and stats.get("p2p_failed_transfers") == 3
    finally:
        evil.close()
        cons.llm_engine.shutdown()


class _ClaimingPeer:
    """A bare TCP server that speaks just enough ZMTP 3.0 (NULL security, a ROUTER) to answer the first
    READ with an "OK" frame and a frame whose length prefix claims `claim` bytes, then sends nothing more
    and holds the connection (a real attacker would stream the bytes)."""

    def __init__(self, port: int, claim: int):
        import socket

        self.srv = socket.create_server(("127.0.0.1", port))
        self.claim = claim
        self.answered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        import struct

        conn, _ = self.srv.accept()
        with conn:
            greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
            conn.sendall(greeting)
            ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"ROUTER"
            conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
            seen = b""
            conn.settimeout(0.1)
            while b"READ" not in seen.replace(b"READY", b"") and not self._stop.is_set():
                try:
                    seen += conn.recv(65536)
                except TimeoutError:
                    continue
            # "OK" (more follows), then a long frame claiming `claim` bytes, and the first KiB of them
            conn.sendall(b"\x01\x02OK" + b"\x02" + struct.pack(">Q", self.claim) + bytes(1024))
            self.answered.set()
            self._stop.wait()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.srv.close()


def test_a_frame_claiming_a_gigabyte_is_refused_unstored(ckpt):
    """10. A peer's frame is allocated at the size its length prefix claims and handed over only once it all
    arrived: a frame claiming 1 GiB made the consumer reserve it and wait for the rest (until
    transfer_timeout_s, an hour here; `_run_until` gave up after 40 s). The consumer's sockets accept frames
    up to what a request's blocks hold (ZMQ_MAXMSGSIZE): a larger one drops the peer before it is stored,
    and the request is recomputed at once."""
    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    cons, worker = _p2p_consumer(ckpt, transfer_timeout_s=3600)
    port = get_open_port()
    peer = _ClaimingPeer(port, 1 << 30)
    try:
        finished = {}
        cons.llm_engine.add_request("big", {"prompt_token_ids": PROMPT}, _sp(_pull_params(port)))
        _run_until(cons, "big", finished)
        assert peer.answered.is_set()  # the claim was really sent
        assert finished["big"].outputs[0].token_ids == want  # recomputed
        assert _connector_stats(cons).get("p2p_failed_transfers") == 1
        # the tiny llama at max_model_len=128: 8 blocks of K and V (16 tokens x 2 heads x 16 dims x 4 bytes)
        # are 32 KiB; a header's 64 KiB is the larger
        assert worker.max_frame_bytes == 64 << 10
    finally:
        peer.close()
        cons.llm_engine.shutdown()


# ---- third pass: a directory where a stored file should be ----


def _plant_directory(path) -> None:
    "Replace the file at `path` by a non-empty directory (anyone who can write the storage folder can)."
    path.unlink()
    path.mkdir()
    (path / "x").write_text("x")


def test_example_connector_directory_is_a_miss_not_a_crash(ckpt, tmp_path):
    """13. ExampleConnector: a directory in place of a stored block's file counted as stored; the load failed
    and deleting it (`unlink`) raised `IsADirectoryError` out of `start_load_kv`: the engine died. Only a
    regular file counts as stored, and removing an entry never raises: the blocks are recomputed."""
    ref = _llm(ckpt)
    want = ref.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    ref.llm_engine.shutdown()
    kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = _llm(ckpt, kvt)
    llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)
    llm.llm_engine.shutdown()
    stored = sorted(tmp_path.glob("*.safetensors"))
    assert len(stored) == 2
    for f in stored:
        _plant_directory(f)
    llm = _llm(ckpt, kvt)
    try:
        counts = _count_scheduled(llm)
        out = llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        assert sum(counts) == len(PROMPT) + MAX_TOKENS - 1  # a miss: computed once, no failed load
        out = llm.generate([{"prompt_token_ids": PROMPT}], _sp(), use_tqdm=False)[0]  # it still serves
        assert out.outputs[0].token_ids == want
    finally:
        llm.llm_engine.shutdown()


def test_ec_connector_directory_is_encoded_not_a_crash(tmp_path_factory, tmp_path):
    """14. ECExampleConnector: a directory in place of an encoder output's file was found, failed to load,
    and `unlink` raised `IsADirectoryError` out of `start_load_caches`: the engine died. Only a regular file
    is an item; the image is encoded instead (the plain tokens)."""
    import numpy as np
    from PIL import Image

    g3 = make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))
    img = Image.fromarray(np.random.default_rng(5).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    req = {"prompt": "<bos>Look at <start_of_image> and say", "multi_modal_data": {"image": [img]}}
    ect = {"ec_connector": "ECExampleConnector", "ec_role": "ec_both",
           "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    llm = LLM(g3, dtype="float32", block_size=4, ec_transfer_config=ect)
    want = llm.generate([req], _sp(), use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.shutdown()
    (stored,) = tmp_path.rglob("encoder_cache.safetensors")
    _plant_directory(stored)
    llm = LLM(g3, dtype="float32", block_size=4, ec_transfer_config=ect)
    try:
        assert (
            llm.llm_engine.engine_core.engine_core.scheduler.ec_connector.has_cache_item(stored.parent.name)
            is False
        )
        for _ in range(2):
            assert llm.generate([req], _sp(), use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        llm.llm_engine.shutdown()


def test_lmcache_disk_directory_is_a_miss_not_a_hit(tmp_path):
    """15. LMCache's disk tier: a directory in place of a chunk file counted as stored (`contains`), so every
    request with that prefix was granted the chunk, failed to load it and recomputed; `get` raised
    `IsADirectoryError` (deleting it) instead of returning a miss. Only a regular file is a chunk."""
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
        LocalDiskBackend,
    )
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import CacheEngineKey

    disk = LocalDiskBackend(tmp_path, 1 << 20)
    key = CacheEngineKey("m", 1, 0, "abc", "float32")
    disk._file(key).mkdir()
    (disk._file(key) / "x").write_text("x")
    assert disk.contains(key) is False
    assert disk.get(key) is None and disk.num_errors == 1
    assert disk.remove(key) is False


def test_lmcache_disk_dangling_link_does_not_stop_start_up(tmp_path):
    """16. LMCache's disk tier rebuilt its index with `p.stat()` on every `*.kvchunk`: one dangling symbolic
    link (or a file removed meanwhile) raised `FileNotFoundError` from the constructor, so no engine on that
    folder could start, again after every restart. Entries that are not regular files are skipped."""
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.storage_backend import (
        LocalDiskBackend,
    )

    (tmp_path / ("a" * 64 + ".kvchunk")).symlink_to(tmp_path / "gone")
    (tmp_path / ("b" * 64 + ".kvchunk")).symlink_to("/dev/zero")
    (tmp_path / ("c" * 64 + ".kvchunk")).mkdir()
    disk = LocalDiskBackend(tmp_path, 1 << 20)
    assert disk.used_bytes == 0 and len(disk._index) == 0


def test_engine_core_yields_while_only_waiting_for_remote_kv():
    """17. While every request waits for remote KV (`WAITING_FOR_REMOTE_KVS`), `EngineCoreProc`'s busy loop
    stepped without running the model as fast as it could (~20,000 steps/s), holding the GIL against the
    pull thread and the socket threads of the same process: through `minivllm serve`, 8 requests pulling from
    a silent peer made a plain request beside them take 10.8 s instead of 0.8 s, and the bad pulls' 10 s
    timeouts fired after 41 s. A step that ran no model while requests remain sleeps 1 ms (vLLM v0.15
    v1/engine/core.py `EngineCoreProc._process_engine_step`): such steps are at most one a millisecond."""
    import queue

    from minivllm.v1.engine.core import EngineCoreProc

    ran = [False]
    proc = SimpleNamespace(
        step_fn=lambda: ({}, ran[0]),
        scheduler=SimpleNamespace(has_requests=lambda: True, has_unfinished_requests=lambda: True),
        output_queue=queue.Queue(),
        batch_queue=None,
    )
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 0.2:
        EngineCoreProc._process_engine_step(proc)
        n += 1
    elapsed = time.monotonic() - t0
    assert n <= elapsed / 1e-3 + 1, f"{n} idle steps in {elapsed:.3f} s: the loop never yields"
    ran[0] = True  # a step that ran the model goes straight on
    n, t0 = 0, time.monotonic()
    while n < 5000:
        EngineCoreProc._process_engine_step(proc)
        n += 1
    assert time.monotonic() - t0 < 4.0  # 5000 sleeps of 1 ms would take at least 5 s
