"""A LoRA adapter folder rewritten in place under a running engine (break pass 15B, item 1).

1. Engine A (ExampleConnector, or LMCache's disk tier) served adapter `a` (id 1) from folder `live` (= a1);
   the folder's two files were then replaced by a2's (a new version, same name and id). A kept a1's
   weights loaded, but `connector_salt` fingerprinted the folder on disk for every request, so A stored KV
   computed with a1's weights under a2's fingerprint, and a fresh engine B serving the folder (now a2)
   loaded it: [375, 415, 122, 304, 434, 434] instead of a2's [197, 244, 172, 411, 284, 165]. Now the salt
   is the content the engine pinned when it first took the adapter (`LoRARequest.lora_fingerprint`,
   chapter 23), A's requests of the changed folder fail with an error, and B computes a2's tokens.
2. After an in-place replacement, the worker's reload of the adapter (after an LRU unload) read the new
   files and computed with them under the old pin. Now the scheduler fails that request with an error
   naming the adapter (name and path, "load the new version under a new lora_name") while a base-model
   request of the same batch is answered and the engine keeps serving; the new version under a new name
   is served; and the worker's own reload check refuses the changed folder (`LoRAAdapterChangedError`).
"""

import shutil

import msgspec
import pytest
from test_kv_connector_break_10 import _store  # tests/ is on sys.path

from minivllm import LLM, SamplingParams

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_lora import _two_adapters  # tests/ is on sys.path

    from minivllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("lora_in_place")
    path = _two_adapters(root)
    kw = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20,
              enable_lora=True, max_lora_rank=8, max_loras=1, enable_prefix_caching=False)  # fmt: skip
    ref = LLM(path, **kw)
    try:
        want = {
            "base": _run(ref, None),
            "a1": _run(ref, LoRARequest("x", 1, str(root / "a1"))),
            "a2": _run(ref, LoRARequest("y", 2, str(root / "a2"))),
        }
    finally:
        ref.llm_engine.shutdown()
    assert want["a1"] != want["a2"] != want["base"]  # the adapters change the tokens
    return path, kw, want, root


def _outs(llm, loras):
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: two full blocks of 16
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate([prompt] * len(loras), sp, use_tqdm=False, lora_request=loras)]


def _run(llm, lora) -> list[int]:
    return list(_outs(llm, [lora])[0].token_ids)


def _live(root, name: str):
    "A fresh folder `name` holding a1's files, and the request serving it as adapter 'a' (id 1)."
    from minivllm.lora.request import LoRARequest

    live = root / name
    shutil.rmtree(live, ignore_errors=True)
    shutil.copytree(root / "a1", live)
    return live, LoRARequest("a", 1, str(live))


def _replace_in_place(root, live) -> None:
    for f in FILES:  # deploy the new version in place: same folder, name and id
        shutil.copy(root / "a2" / f, live / f)


def _assert_refused(out, live) -> None:
    assert out.finish_reason == "error" and list(out.token_ids) == []
    message = str(out.stop_reason)
    assert "'a'" in message and str(live) in message and "new lora_name" in message, message


@pytest.mark.parametrize("kind", ["ExampleConnector", "LMCacheConnectorV1"])
def test_kv_of_the_old_weights_is_not_found_under_the_new_files(setup, kind):
    """1. Before: A stored its a1-computed KV under a2's fingerprint; B (new files) loaded it and answered
    [375, 415, 122, 304, 434, 434], not a2's tokens. Now A's salt stays a1's pin, A refuses the changed
    folder, and B answers exactly what an engine without a connector answers for a2."""
    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import connector_salt
    from minivllm.lora.models import adapter_fingerprint

    path, kw, want, root = setup
    live, lora = _live(root, f"live-{kind}")
    pin = adapter_fingerprint(str(live))
    store = root / f"store-{kind}"
    first = LLM(path, **kw, kv_transfer_config=_store(kind, store))
    try:
        assert _run(first, lora) == want["a1"]  # stores a1's KV
        _replace_in_place(root, live)
        after = _outs(first, [lora])[0]  # was: answered with a1's weights, stored as a2's
        scheduler = first.llm_engine.engine_core.engine_core.scheduler
        pins = getattr(scheduler, "_lora_pins", None)  # what A's keys name: a1's content
    finally:
        first.llm_engine.shutdown()
    later = LLM(path, **kw, kv_transfer_config=_store(kind, store))
    try:
        assert _run(later, lora) == want["a2"], "B was served the KV A computed with a1's weights"
    finally:
        later.llm_engine.shutdown()
    _assert_refused(after, live)
    assert pins == {1: pin}
    pinned = msgspec.structs.replace(lora, lora_fingerprint=pin)  # the scheduler's copy of the request
    assert connector_salt(type("R", (), {"cache_salt": None, "lora_request": pinned})) == f'[null, "{pin}"]'
    assert lora.lora_fingerprint is None  # the caller's object is not changed


def test_a_reload_of_a_rewritten_folder_fails_the_request_not_the_engine(setup):
    """2. One host slot (max_cpu_loras=1): adapter 'a' is loaded, then unloaded by 'b'; its folder gets a2's
    files. Before: the reload read them and answered a2's tokens under a1's pin (the key its KV is stored
    by). Now 'a' fails with the error naming it, the base-model request of the same batch gets the base
    tokens, and the engine goes on: 'b' again, and the new version under a new name."""
    from minivllm.lora.request import LoRARequest

    path, kw, want, root = setup
    live, lora = _live(root, "live-reload")
    other = LoRARequest("b", 2, str(root / "a2"))
    llm = LLM(path, **kw, max_cpu_loras=1)
    try:
        assert _run(llm, lora) == want["a1"]
        assert _run(llm, other) == want["a2"]  # unloads 'a' (one host slot)
        _replace_in_place(root, live)
        refused, base = _outs(llm, [lora, None])
        _assert_refused(refused, live)
        assert list(base.token_ids) == want["base"] and base.finish_reason == "length"
        assert _run(llm, other) == want["a2"]  # the engine keeps serving
        assert _run(llm, LoRARequest("a-v2", 3, str(live))) == want["a2"]  # the new version, a new name
    finally:
        llm.llm_engine.shutdown()


def test_the_workers_reload_refuses_a_rewritten_folder(setup):
    """2. The worker's backstop (a folder rewritten between the scheduler's check and the read): before,
    `add_adapter` read whatever the folder held; now a reload after an unload raises
    `LoRAAdapterChangedError` naming the adapter, and nothing of it stays loaded."""
    from minivllm.lora.models import LoRAAdapterChangedError, adapter_fingerprint

    path, kw, want, root = setup
    live, lora = _live(root, "live-worker")
    pinned = msgspec.structs.replace(lora, lora_fingerprint=adapter_fingerprint(str(live)))
    llm = LLM(path, **kw)
    try:
        manager = (
            llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.lora_manager
        )
        assert manager.add_adapter(pinned)
        manager.remove_adapter(1)  # as the LRU unloads it
        _replace_in_place(root, live)
        with pytest.raises(LoRAAdapterChangedError, match="new lora_name"):
            manager.add_adapter(pinned)
        assert 1 not in manager.list_adapters()
    finally:
        llm.llm_engine.shutdown()
