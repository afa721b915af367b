"""A ninth try-to-break pass on the KV connectors (issue 30), by a second fresh helper.

1. `kv_transfer_params` that is not a dict (`SamplingParams(extra_args={"kv_transfer_params": [1, 2]})`)
   reached the P2P connector inside the scheduler (`params.get`): AttributeError in every later step, the
   request stuck in `waiting`, the engine serving nobody. `SamplingParams` now refuses it, and flags that are
   no booleans (`"do_remote_decode": "false"` held a producer's blocks for 120 s), before the engine.
2. A request asking for prompt logprobs skipped the local prefix cache, but a connector still loaded its
   stored KV: the loaded positions came back as logprob 0.0 for token 0 (silently wrong). Such a request now
   loads nothing (a P/D consumer still tells its producer to free).
3. The checkpoint fingerprint ignored the image processor's settings: a changed `preprocessor_config.json`
   at the same path was served the old encoder outputs. They are hashed too.
4. The fingerprint memo left a temporary file per start when it could not be replaced (chapter 36).
5. LMCache settings that are no setting were taken silently: a bool that is no bool ("ture", 2, [1])
   became False, a misspelt `lmcache.` key was ignored, a list became a folder name. Now a ValueError
   naming the key.
"""

import json
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.model_executor.model_loader import checkpoint_fingerprint
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.executor.multiproc_executor import get_open_port

KW = dict(dtype="float32", max_model_len=128, block_size=16, kv_cache_memory_bytes=4 << 20)
PROMPT = list(range(5, 5 + 50))


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_transfer_params_of_the_wrong_shape_are_refused_and_the_engine_keeps_serving(llama, role):
    llm = LLM(llama, **KW, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": role,
                                               "kv_port": get_open_port()})  # fmt: skip
    try:
        for bad, says in (([1, 2], "kv_transfer_params must be a dict"),
                          ({"do_remote_decode": "false"}, "kv_transfer_params.do_remote_decode"),
                          ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill")):  # fmt: skip
            with pytest.raises(ValueError, match=says):
                llm.generate([{"prompt_token_ids": PROMPT}],
                             SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": bad}), use_tqdm=False)  # fmt: skip
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2  # was: AttributeError in every step after the list
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert not scheduler.waiting and not scheduler.running
    finally:
        llm.llm_engine.shutdown()


def _prompt_logprobs(llm):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    return [None if d is None else (tid, round(d[tid].logprob, 4)) for tid, d in zip(PROMPT, out.prompt_logprobs)]


@pytest.mark.parametrize("kind", ["ExampleConnector", "LMCacheConnectorV1"])
def test_prompt_logprobs_with_stored_kv_equal_those_without_a_connector(llama, tmp_path, kind):
    ref = LLM(llama, **KW)
    try:
        want = _prompt_logprobs(ref)
    finally:
        ref.llm_engine.shutdown()
    extra = {"shared_storage_path": str(tmp_path)} if kind == "ExampleConnector" else {"chunk_size": 16}
    llm = LLM(llama, **KW, kv_transfer_config={"kv_connector": kind, "kv_role": "kv_both",
                                               "kv_connector_extra_config": extra})  # fmt: skip
    try:
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2), use_tqdm=False)  # stores
        assert _prompt_logprobs(llm) == want  # was: (0, 0.0) at the 48 loaded positions
    finally:
        llm.llm_engine.shutdown()


def test_the_image_processors_settings_are_part_of_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = Path(make_tiny_checkpoint("gemma3_mm", tmp_path / "g3mm"))
    names = [n for n in ("preprocessor_config.json", "processor_config.json") if (ckpt / n).is_file()]
    assert names, "the tiny Gemma 3 checkpoint has an image processor config"
    before = checkpoint_fingerprint(ckpt)
    cfg = json.loads((ckpt / names[0]).read_text())
    cfg["do_normalize"] = not cfg.get("do_normalize", True)
    (ckpt / names[0]).write_text(json.dumps(cfg))
    assert checkpoint_fingerprint(ckpt) != before  # was: equal, so the old encoder outputs were served


@pytest.mark.parametrize("extra, says", [
    ({"use_layerwise": "ture"}, "use_layerwise must be true or false"),
    ({"local_cpu": [1]}, "local_cpu must be true or false"),
    ({"save_unfull_chunk": 2}, "save_unfull_chunk must be true or false"),
    ({"lmcache.chunk_sise": 64}, "unknown LMCache setting 'lmcache.chunk_sise'"),
    ({"local_disk": ["a", "b"]}, "local_disk must be a string"),
])  # fmt: skip
def test_lmcache_settings_that_are_no_setting_are_refused(extra, says):
    "5. A bool that is no bool became False, a misspelt `lmcache.` key was ignored, a list became a folder name."
    from minivllm.config import KVTransferConfig
    from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import lmcache_get_config

    kvt = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config=extra)
    with pytest.raises(ValueError, match=says):
        lmcache_get_config(kvt, environ={})
    assert lmcache_get_config(KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                                               kv_connector_extra_config={"local_cpu": "off"}), environ={}).local_cpu is False  # fmt: skip
