"""Issue 30, tenth break pass: what it found, each with its regression test.

1. A P/D consumer shut down while a pull was reading (a server stopped, or restarted, mid-request) said
   nothing to its producer, which kept the request's blocks until its `abort_timeout_s` (120 s). The pull
   thread now says DONE for each pull still reading before it closes its sockets (chapter 47e,
   `_say_goodbye`).
2. A LoRA adapter was named by its name only in ExampleConnector's and LMCache's keys: an engine serving
   other weights under the same name (a new version, or another server's folder on a shared store) loaded
   the first adapter's stored KV (wrong tokens, nothing logged). `connector_salt` now names it by content
   (`adapter_fingerprint`, chapter 30j), as does the P2P `prompt_digest`.
3. `connector_salt` joined the salt and the adapter into one string (`f"{salt}|lora:{name}"`), so a
   base-model request with `cache_salt="|lora:a"` stored KV that adapter `a` then loaded. It is now the
   JSON list `[salt, adapter]` (chapter 47c).
4. The same collision inside one engine's prefix cache: the LoRA name and the salt were both bare strings
   among a block's extra keys, so `cache_salt="a"` on the base model and adapter `a` shared blocks. Both
   are tagged now (`("lora", name)`, `("cache_salt", salt)`, chapter 11).
5. A request the decode server refused before its engine (a prompt longer than its `max_model_len`, a
   model name only the prefill server serves) left the producer's blocks held for `abort_timeout_s`: the
   proxy's release asked the decode server for a one-token request, which it refused too. The producer's
   parameters now carry `prompt_digest`, and the proxy says DONE itself (`release_remote_blocks`,
   chapter 47e).
6. A client that gave up on a non-streamed request through the proxy left the decode server generating all
   of its `max_tokens` for nobody (Starlette does not cancel a handler whose client left): the proxy now
   races each backend call against the client's disconnect and cancels it (`examples/disagg_proxy.py`
   `_unless_gone`), so the backend aborts the request.
7. An encoder-only instance (`ec_role` `ec_producer`) with a KV connector failed with "ExampleConnector
   supports one KV cache group; this model has 0" (LMCache the same), and a P2P producer started and answered
   every request with token 0. It is refused when the engine's config is built, naming both settings
   (chapter 29a, `_check_transfer_roles`).
"""

import time

import pytest
from test_kv_connector_break_8 import PROMPT, FakeProducer, _consumer, _params, _wait  # tests/ is on sys.path

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_a_consumer_shut_down_mid_pull_tells_the_producer_done(ckpt):
    port = get_open_port()
    fake = FakeProducer(port)  # answers every READ with RETRY: the pull keeps reading
    llm = _consumer(ckpt, transfer_timeout_s=30)
    engine = llm.llm_engine
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            extra_args={"kv_transfer_params": _params(port)})  # fmt: skip
        engine.add_request("cut", {"prompt_token_ids": PROMPT}, sp)
        assert _wait(lambda: len(fake.reads) >= 1, 10, engine.step)
        assert fake.dones == []
        t0 = time.monotonic()
        engine.shutdown()
        shutdown_s = time.monotonic() - t0
        assert _wait(lambda: fake.dones, 2), "the producer heard no DONE: it would hold the blocks 120 s"
        assert len(fake.dones) == 1 and fake.dones[0].startswith("cut")
        assert shutdown_s < 5, f"shutdown took {shutdown_s:.1f} s"
    finally:
        engine.shutdown()
        fake.close()


def test_a_consumer_shut_down_mid_pull_to_a_dead_producer_stops_at_once(ckpt):
    port = get_open_port()  # nobody listens: the DONE cannot be delivered
    llm = _consumer(ckpt, transfer_timeout_s=30)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                        extra_args={"kv_transfer_params": _params(port)})  # fmt: skip
    engine.add_request("cut", {"prompt_token_ids": PROMPT}, sp)
    for _ in range(3):
        engine.step()
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < 3  # the half-second linger, not a hang


# --- 2-4: a LoRA adapter is named by its content in stored KV, and a salt never passes for an adapter ---


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from test_lora import _two_adapters  # tests/ is on sys.path

    from minivllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("lora")
    path = _two_adapters(root)
    kw = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20,
              enable_lora=True, max_lora_rank=8, max_loras=1)  # fmt: skip
    a1 = LoRARequest("a", 1, str(root / "a1"))
    a2 = LoRARequest("a", 1, str(root / "a2"))  # another version deployed under the same name
    ref = LLM(path, **kw, enable_prefix_caching=False)
    try:
        want = {
            "base+salt": _lora_run(ref, salt="a"),
            "a1": _lora_run(ref, a1),
            "a2": _lora_run(ref, LoRARequest("b", 2, str(root / "a2"))),
        }
    finally:
        ref.llm_engine.shutdown()
    assert want["a1"] != want["a2"] != want["base+salt"]  # the adapters change the tokens
    return path, kw, a1, a2, want, root


def _lora_run(llm, lora=None, salt=None) -> list[int]:
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: two full blocks of 16
    if salt is not None:
        prompt["cache_salt"] = salt
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return list(llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids)


def _store(kind: str, folder) -> dict:
    if kind == "ExampleConnector":
        extra = {"shared_storage_path": str(folder)}
    else:
        extra = {"chunk_size": 16, "local_cpu": False, "local_disk": str(folder), "max_local_disk_size": 0.05}
    return {"kv_connector": kind, "kv_role": "kv_both", "kv_connector_extra_config": extra}


@pytest.mark.parametrize("kind", ["ExampleConnector", "LMCacheConnectorV1"])
def test_another_adapter_under_the_same_name_finds_no_stored_kv(lora_setup, kind):
    path, kw, a1, a2, want, root = lora_setup
    store = root / f"same-name-{kind}"
    first = LLM(path, **kw, enable_prefix_caching=False, kv_transfer_config=_store(kind, store))
    try:
        assert _lora_run(first, a1) == want["a1"]  # stores a1's KV
    finally:
        first.llm_engine.shutdown()
    later = LLM(path, **kw, enable_prefix_caching=False, kv_transfer_config=_store(kind, store))
    try:
        assert _lora_run(later, a2) == want["a2"], "a2 was served a1's stored KV (same name 'a')"
    finally:
        later.llm_engine.shutdown()


@pytest.mark.parametrize("kind", ["ExampleConnector", "LMCacheConnectorV1", None])
def test_a_salt_that_spells_an_adapter_is_no_adapter(lora_setup, kind):
    "Base-model KV stored under cache_salt 'a' (or '|lora:a', the old key) is not found by adapter 'a'."
    path, kw, a1, _, want, root = lora_setup
    if kind is None:  # the prefix cache alone: the salt and the LoRA name were the same extra key
        llm = LLM(path, **kw, enable_prefix_caching=True)
    else:
        llm = LLM(
            path, **kw, enable_prefix_caching=False, kv_transfer_config=_store(kind, root / f"salt-{kind}")
        )
    try:
        assert _lora_run(llm, salt="a") == want["base+salt"]
        _lora_run(llm, salt="|lora:a")
        assert _lora_run(llm, a1) == want["a1"], "adapter 'a' was served the base model's KV"
    finally:
        llm.llm_engine.shutdown()


# --- 5: a request the decode server refuses before its engine still frees the producer's blocks at once ---


def test_a_prompt_too_long_for_the_decode_server_frees_the_producers_blocks(tmp_path_factory):
    "The decode server's max_model_len is 64, the prompt 100 tokens: the proxy releases via DONE itself."
    from fastapi.testclient import TestClient
    from test_disagg_proxy import disagg_proxy  # tests/ is on sys.path: the proxy, loaded once
    from test_server import API_KEY, Server

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.v1.engine.async_llm import AsyncLLM

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))

    def server(kvt, max_model_len):
        args = EngineArgs(model=path, dtype="float32", max_model_len=max_model_len, block_size=16,
                          kv_cache_memory_bytes=1 << 20, kv_transfer_config=kvt)  # fmt: skip
        return Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))

    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": get_open_port(),
           "kv_connector_extra_config": {"abort_timeout_s": 120}}  # fmt: skip
    prod = server(kvt, 128)
    cons = server({"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"}, 64)
    try:
        scheduler = prod.engine.engine_core.scheduler
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        with TestClient(disagg_proxy.build_app(prod.url, cons.url)) as proxy:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            for stream in (False, True):
                r = proxy.post("/v1/completions", headers=headers,
                               json={"model": "tiny", "prompt": list(range(5, 105)), "max_tokens": 4,
                                     "stream": stream})  # fmt: skip
                assert r.status_code == 400 and "maximum context length" in r.text, r.text
            t0 = time.monotonic()
            assert _wait(lambda: not scheduler.delayed_free_req_ids, 10), (
                "the producer still holds the blocks"
            )
            prod.wait_idle()
            assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
            print(f"the producer freed the refused requests' blocks {time.monotonic() - t0:.2f} s later")
    finally:
        prod.stop()
        cons.stop()


# --- 6: a client that leaves the proxy aborts its request on the decode server ---


def _generated(server) -> float:
    "The server's vllm:generation_tokens_total."
    lines = [
        ln for ln in server.get("/metrics").splitlines() if ln.startswith("vllm:generation_tokens_total")
    ]
    return float(lines[0].rsplit(" ", 1)[1])


def test_a_client_that_leaves_the_proxy_aborts_its_decode(tmp_path_factory):
    "Non-streamed, 3000 tokens asked, the client gives up after 0.5 s: the decode server must not finish it."
    import httpx
    from test_disagg_proxy import disagg_proxy  # tests/ is on sys.path: the proxy, loaded once
    from test_server import API_KEY, Server

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.v1.engine.async_llm import AsyncLLM

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=8192)

    def server(kvt):
        args = EngineArgs(model=path, dtype="float32", max_model_len=4096, block_size=16,
                          kv_cache_memory_bytes=4 << 20, kv_transfer_config=kvt)  # fmt: skip
        return Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))

    prod = server({"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": get_open_port()})
    cons = server({"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"})
    proxy = ServerThread(disagg_proxy.build_app(prod.url, cons.url)).start()
    try:
        body = {"model": "tiny", "prompt": "Go on", "max_tokens": 3000, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proxy.url + "/v1/completions", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        cons.wait_idle(timeout=60)
        prod.wait_idle(timeout=60)
        generated = _generated(cons)
        print(f"the decode server generated {generated:.0f} of 3000 tokens for the client that left")
        assert generated < 3000, "the decode server finished the request for nobody"
        assert not prod.engine.engine_core.scheduler.delayed_free_req_ids  # and the producer was told DONE
    finally:
        proxy.stop()
        prod.stop()
        cons.stop()


# --- 7: an encoder-only instance (ec_producer) with a KV connector is refused, naming both settings ---


@pytest.mark.parametrize("connector", ["ExampleConnector", "LMCacheConnectorV1", "P2pZmqConnector"])
def test_an_encoder_only_instance_refuses_a_kv_connector(tmp_path_factory, tmp_path, connector):
    ckpt = make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))
    role = "kv_producer" if connector == "P2pZmqConnector" else "kv_both"
    kvt = {"kv_connector": connector, "kv_role": role,
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}  # fmt: skip
    ect = {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
           "ec_connector_extra_config": {"shared_storage_path": str(tmp_path / "ec")}}  # fmt: skip
    with pytest.raises(ValueError, match="ec_role is ec_producer.*no KV cache"):
        LLM(ckpt, dtype="float32", max_model_len=256, kv_transfer_config=kvt, ec_transfer_config=ect)


# --- 8: a decode server that is down, fails or answers garbage frees the producer's blocks at once ---


def test_a_decode_server_that_takes_nothing_frees_the_producers_blocks(tmp_path_factory):
    "Down (503), a 500, or a 200 that is not JSON: each was a request whose blocks the producer kept 120 s."
    from fastapi.testclient import TestClient
    from test_disagg_proxy import _Backend, _free_port, _reply_with, disagg_proxy  # tests/ is on sys.path
    from test_server import API_KEY, Server

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.v1.engine.async_llm import AsyncLLM

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    kvt = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": get_open_port()}
    args = EngineArgs(model=path, dtype="float32", max_model_len=128, block_size=16,
                      kv_cache_memory_bytes=1 << 20, kv_transfer_config=kvt)  # fmt: skip
    prod = Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))
    failing = _Backend(reply=_reply_with(500, b"Internal Server Error", "text/plain"))
    garbage = _Backend(reply=_reply_with(200, b"<html>", "text/html"))
    try:
        scheduler = prod.engine.engine_core.scheduler
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        for decode, status in (
            (f"http://127.0.0.1:{_free_port()}", 503),
            (failing.url, 500),
            (garbage.url, 502),
        ):
            with TestClient(disagg_proxy.build_app(prod.url, decode)) as proxy:
                for stream in (False, True) if status != 502 else (False,):  # a 200 stream is relayed as is
                    r = proxy.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                   json={"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 4,
                                         "stream": stream})  # fmt: skip
                    assert r.status_code == status, r.text
            assert _wait(lambda: not scheduler.delayed_free_req_ids, 10), f"held after a {status}"
        prod.wait_idle()
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    finally:
        failing.stop()
        garbage.stop()
        prod.stop()
