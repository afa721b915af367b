"""LoRA requests at the engine's edges (issue 32): the msgspec round trip of an `EngineCoreRequest` carrying a
`LoRARequest`, the front end's refusals (each a ValueError naming the field, nothing queued), the flags, and
prefix caching keyed by adapter (same tokens under another adapter: no hit; under the same adapter: a hit).
Adapters are written with `minivllm.lora.models.make_random_lora_adapter` (no peft needed here)."""

import argparse
import json

import msgspec
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.llm import LLM
from minivllm.lora.models import make_random_lora_adapter
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine import EngineCoreRequest
from minivllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


def test_engine_core_request_round_trip():
    lora = LoRARequest("sql", 3, "/adapters/sql", base_model_name="tiny")
    req = EngineCoreRequest(
        "r1", [1, 2, 3], None, SamplingParams(max_tokens=4), None, 2, 1.5, lora_request=lora
    )
    for back in (
        msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest),
        MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req)),
    ):
        assert isinstance(back.lora_request, LoRARequest)
        assert (back.lora_request.lora_name, back.lora_request.lora_int_id) == ("sql", 3)
        assert (back.lora_request.lora_path, back.lora_request.base_model_name) == ("/adapters/sql", "tiny")
    plain = msgspec.msgpack.decode(
        msgspec.msgpack.encode(EngineCoreRequest("r2", [1], None, None, None, None, 0.0)),
        type=EngineCoreRequest,
    )
    assert plain.lora_request is None


def test_flags():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4"]
    )
    ea = EngineArgs.from_cli_args(args)
    assert (ea.enable_lora, ea.max_loras, ea.max_lora_rank, ea.max_cpu_loras) == (True, 2, 8, 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_req")
    path = make_tiny_checkpoint("llama", root / "base")
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    return root, path, cfg


@pytest.fixture(scope="module")
def llm(tiny):
    _, path, _ = tiny
    return LLM(path, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8, max_loras=2)


PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(10, 47))}  # 37 tokens: 2 full blocks of 16 can be reused


def _refused(llm, lora, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=lora)
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_not_enabled(tiny):
    root, path, cfg = tiny
    plain = LLM(path, dtype="float32", max_model_len=128)
    adapter = make_random_lora_adapter(str(root / "ok"), cfg, rank=4)
    _refused(plain, LoRARequest("ok", 1, adapter), "lora_request: .*not enabled.*--enable-lora")


def test_bad_adapters_are_refused_naming_the_field(tiny, llm):
    root, _, cfg = tiny
    _refused(llm, LoRARequest("missing", 1, str(root / "nope")), "lora_path")
    _refused(
        llm, LoRARequest("r16", 2, make_random_lora_adapter(str(root / "r16"), cfg, rank=16)), "max_lora_rank"
    )
    other = cfg.__class__(**{**cfg.to_dict(), "hidden_size": 32, "intermediate_size": 64})
    _refused(
        llm,
        LoRARequest("other", 3, make_random_lora_adapter(str(root / "other"), other, rank=4)),
        "lora_path: .*the model needs",
    )
    d = make_random_lora_adapter(str(root / "lm_head"), cfg, rank=4)
    with open(f"{d}/adapter_config.json") as f:
        config = json.load(f)
    config["target_modules"] = ["q_proj", "lm_head"]
    with open(f"{d}/adapter_config.json", "w") as f:
        json.dump(config, f)
    _refused(llm, LoRARequest("lm_head", 4, d), "target_modules: \\['lm_head'\\]")
    with open(f"{d}/adapter_config.json", "w") as f:
        f.write("[1, 2")
    _refused(llm, LoRARequest("broken", 5, d), "lora_path: .*not valid JSON")
    _refused(llm, "not-a-request", "lora_request must be a LoRARequest")
    ok = make_random_lora_adapter(str(root / "ok2"), cfg, rank=4)
    assert (
        len(
            llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest("ok2", 6, ok))[0]
            .outputs[0]
            .token_ids
        )
        == 3
    )
    _refused(
        llm, LoRARequest("impostor", 6, ok), "lora_int_id 6 is already adapter 'ok2'"
    )  # same id, other adapter
    # the engine still serves after the refusals
    assert len(llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_prefix_cache_hits_only_within_one_adapter(tiny, llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CHECK_INVARIANTS", "1")
    root, _, cfg = tiny
    a = LoRARequest("pa", 11, make_random_lora_adapter(str(root / "pa"), cfg, rank=8, seed=1))
    b = LoRARequest("pb", 12, make_random_lora_adapter(str(root / "pb"), cfg, rank=8, seed=2))
    prompt = {"prompt_token_ids": list(range(60, 97))}

    def run(lora):
        out = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    base_hits, base_tokens = run(None)
    a_hits, a_tokens = run(a)
    b_hits, b_tokens = run(b)
    a2_hits, a2_tokens = run(a)
    base2_hits, _ = run(None)
    assert (base_hits, a_hits, b_hits) == (0, 0, 0), (
        "another adapter's (or the base model's) KV blocks were reused"
    )
    assert a2_hits == 32 and a2_tokens == a_tokens
    assert base2_hits == 32
    assert len({tuple(base_tokens), tuple(a_tokens), tuple(b_tokens)}) == 3


def test_unsupported_combinations_are_refused_naming_the_flag(tiny, tmp_path):
    _, path, _ = tiny
    tp = EngineArgs(model=path, enable_lora=True, tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="enable_lora: .*tensor_parallel_size"):
        tp.create_engine_config()
    # a vision-language model: LoRA on its language model (tests/test_lora_multimodal.py)
    mm = make_tiny_checkpoint("gemma3_mm", tmp_path / "mm")
    assert EngineArgs(model=mm, enable_lora=True).create_engine_config().lora_config is not None
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(model=path, enable_lora=True, max_lora_rank=7).create_engine_config()
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=path, enable_lora=True, max_loras=4, max_cpu_loras=2).create_engine_config()
