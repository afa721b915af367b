"""ExampleConnector through the whole engine (tiny random checkpoints, float32, CPU).

Greedy outputs with the connector equal those without it, cold (saving) and warm (loading). A second engine
pointed at the same folder computes only the last prompt token of each stored prompt: the rest comes from
the files. A damaged file is recomputed, not served.
"""
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.core.sched.scheduler import Scheduler

BS = 16
PROMPTS = [
    list(range(3, 3 + 40)),  # two full blocks + 8
    list(range(3, 3 + 33)),  # shares the first two blocks with the first prompt
    list(range(100, 100 + 17)),  # one full block + 1
    list(range(200, 200 + 9)),  # no full block: nothing to store
]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _kvt(folder) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": str(folder)})


def _generate(ckpt, kv_transfer_config=None, prompts=PROMPTS):
    "Token ids per prompt, and the tokens the scheduler sent through the model."
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=BS, kv_transfer_config=kv_transfer_config)
    scheduler: Scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    computed = []
    schedule = scheduler.schedule

    def counting_schedule():
        so = schedule()
        computed.append(so.total_num_scheduled_tokens)
        return so

    scheduler.schedule = counting_schedule
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], sum(computed)
    finally:
        llm.llm_engine.shutdown()


def test_cold_then_warm_equal_no_connector(ckpt, tmp_path):
    ref, _, ref_computed = _generate(ckpt)
    cold, _, _ = _generate(ckpt, _kvt(tmp_path))
    assert cold == ref
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3 and all(f.endswith(".safetensors") for f in files)  # 2 shared blocks + 1
    warm, cached, warm_computed = _generate(ckpt, _kvt(tmp_path))
    assert warm == ref
    assert cached == [32, 32, 16, 0]  # loaded from the folder (a fresh engine has no local hits)
    # only the tokens after the stored blocks ran through the model (plus 5 decode steps each)
    decode = (PARAMS.max_tokens - 1) * len(PROMPTS)
    assert warm_computed == sum(map(len, PROMPTS)) - sum(cached) + decode
    assert ref_computed == sum(map(len, PROMPTS)) - 32 + decode  # the reference's own local hit (prompt 2)


def test_damaged_file_is_recomputed(ckpt, tmp_path):
    ref, _, _ = _generate(ckpt, prompts=PROMPTS[:1])
    _generate(ckpt, _kvt(tmp_path), prompts=PROMPTS[:1])
    for f in tmp_path.iterdir():
        f.write_bytes(b"\0" * 64)  # every stored block is now garbage
    again, _, computed = _generate(ckpt, _kvt(tmp_path), prompts=PROMPTS[:1])
    assert again == ref
    # the step that trusted the 32 stored tokens (8 computed), then all 40 again after the load error, then decode
    decode = PARAMS.max_tokens - 1
    assert computed == (len(PROMPTS[0]) - 32) + len(PROMPTS[0]) + decode


def test_cache_salt_and_model_keep_files_apart(ckpt, tmp_path, tmp_path_factory):
    _generate(ckpt, _kvt(tmp_path), prompts=PROMPTS[:1])
    other = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("other"), seed=1)
    ref, _, _ = _generate(other, prompts=PROMPTS[:1])
    out, cached, _ = _generate(other, _kvt(tmp_path), prompts=PROMPTS[:1])
    assert out == ref and cached == [0]  # another model's files never match
