"""LoRA names and adapters from clients (break pass 16, items 1-4).

1. The engine's own prefix cache keyed an adapter by `lora_name`: one name unloaded and loaded again from
   another folder (the server's load/unload endpoints, or `LoRARequest("a", 2, other)` offline) found the
   first adapter's KV: `[375, 415, 122, 304, 434, 434]` where the second adapter alone gives
   `[197, 244, 172, 411, 284, 165]`. Now the block hash keys carry the adapter's content (chapter 11).
2. With more adapters waiting than the fingerprint cache kept (256), the scheduler's per-step check of each
   waiting request's adapter (chapter 23) read and hashed them again every step: 293 BLAKE3 hashes of whole
   adapter folders per step with 300 adapters waiting. Now it is kept for 16384 (chapter 30j).
3. A lone surrogate in `/v1/load_lora_adapter`'s `lora_name` registered the adapter and answered 500; every
   later `/v1/models` answered 500 too. Now it is a 400 naming the field, nothing registered (chapter 54).
Tiny random llama and PEFT adapters, float32, in this process.
"""

import asyncio
import json
import os
import shutil

import blake3
import pytest
from test_lora import _two_adapters  # tests/ is on sys.path

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.openai.serving_models import LoadLoRAAdapterRequest, OpenAIServingModels
from minivllm.lora.request import LoRARequest

KW = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=1 << 20, enable_lora=True,
          max_lora_rank=8)  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return _two_adapters(root), root


def _run(llm: LLM, lora: LoRARequest) -> list[int]:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(5, 45))}], sp, use_tqdm=False, lora_request=[lora])
    return list(out[0].outputs[0].token_ids)


def test_one_name_for_another_adapter_finds_none_of_the_first_ones_kv(adapters):
    base, root = adapters
    ref = LLM(base, **KW, max_loras=2, enable_prefix_caching=False)
    want = _run(ref, LoRARequest("y", 2, str(root / "a2")))
    ref.llm_engine.shutdown()
    llm = LLM(base, **KW, max_loras=2, enable_prefix_caching=True)
    try:
        _run(llm, LoRARequest("a", 1, str(root / "a1")))
        assert _run(llm, LoRARequest("a", 2, str(root / "a2"))) == want  # same name, new id and folder
    finally:
        llm.llm_engine.shutdown()


def test_many_waiting_adapters_are_not_hashed_again_each_step(adapters, tmp_path, monkeypatch):
    base, root = adapters
    for i in range(300):  # distinct content: the config differs
        shutil.copytree(root / "a1", tmp_path / f"ad{i}")
        cfg_path = tmp_path / f"ad{i}" / "adapter_config.json"
        cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), revision=str(i))))
    hashes = []
    real = blake3.blake3
    monkeypatch.setattr(blake3, "blake3", lambda *a, **k: hashes.append(1) or real(*a, **k))
    llm = LLM(base, **KW, max_loras=1, max_cpu_loras=4, max_num_seqs=8)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        for i in range(300):
            lora = LoRARequest(f"ad{i}", i + 1, str(tmp_path / f"ad{i}"))
            engine.add_request(f"r{i}", {"prompt_token_ids": [5, 6, 7, 8 + i % 50]}, sp, lora_request=lora)
        before = len(hashes)
        for _ in range(20):
            engine.step()
        assert len(hashes) - before == 0, f"{len(hashes) - before} adapter folders hashed again in 20 steps"
    finally:
        engine.shutdown()


def test_a_surrogate_in_lora_name_is_a_400_and_registers_nothing(adapters):
    base, root = adapters
    models = OpenAIServingModels(["tiny"], base, 128)
    request = LoadLoRAAdapterRequest(lora_name="a\udc00", lora_path=str(root / "a1"))
    answer = asyncio.run(models.load_lora_adapter(request))
    assert answer.error.code == 400 and answer.error.param == "lora_name", answer
    assert models.lora_requests == {}
    cards = asyncio.run(models.show_available_models())
    assert [c.id for c in cards.data] == ["tiny"]
    assert os.path.isdir(root / "a1")


def test_pins_and_worker_fingerprints_stay_bounded(adapters, monkeypatch):
    """4. (break pass 16, item 5) Each lora_int_id stayed pinned in the scheduler and fingerprinted in the
    worker forever (1000 ids: 1000 entries each, 2 adapters loaded); a server's every load is a new id. Now
    the scheduler keeps the `_MAX_LORA_PINS` latest (8 here) and the worker only its cached adapters'."""
    from minivllm.v1.core.sched import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "_MAX_LORA_PINS", 8, raising=False)
    base, root = adapters
    llm = LLM(base, **KW, max_loras=1, max_cpu_loras=2)
    try:
        for i in range(12):
            _run(llm, LoRARequest(f"a{i}", i + 1, str(root / "a1")))
        core = llm.llm_engine.engine_core.engine_core
        worker = core.model_executor.driver_worker.model_runner.lora_manager
        assert len(core.scheduler._lora_pins) == 8
        assert set(worker.fingerprints) <= set(worker.adapter_manager.list_adapters())
        assert len(worker.fingerprints) <= 2
    finally:
        llm.llm_engine.shutdown()
