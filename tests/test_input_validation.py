"""Bad input gets a clear ValueError naming the field and the allowed range, raised before it reaches the
engine; the engine is unharmed (running requests continue, the next call succeeds). Greedy is argmax."""
import json

import pytest

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)


GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

BAD_PARAMS = [  # (kwargs, words the message must contain)
    (dict(max_tokens=0), ["max_tokens", "at least 1"]),
    (dict(max_tokens=-3), ["max_tokens", "at least 1"]),
    (dict(temperature=-0.5), ["temperature", "non-negative"]),
    (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p", "(0, 1]"]),
    (dict(top_k=-2), ["top_k", "-1"]),
    (dict(min_p=-0.1), ["min_p", "[0, 1]"]),
    (dict(min_p=1.1), ["min_p", "[0, 1]"]),
    # a lone surrogate: before, a bare UnicodeEncodeError naming no field (sending it to the engine process)
    (dict(stop=["a\ud800"]), ["stop", "lone UTF-16 surrogate"]),
    (dict(extra_args={"kv_transfer_params": {"remote_host": "\udc00"}}), ["extra_args", "surrogate"]),
]


@pytest.mark.parametrize("kwargs,words", BAD_PARAMS)
def test_bad_sampling_params(llm, kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    for w in words: assert w in str(e.value), str(e.value)
    # the same value set after construction is caught by the InputProcessor before the engine
    sp = SamplingParams()
    for k, v in kwargs.items(): setattr(sp, k, v)
    with pytest.raises(ValueError) as e:
        llm.generate("hello", sp, use_tqdm=False)
    assert list(kwargs)[0] in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("hello", GOOD, use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("prompt,words", [
    ("", ["prompt", "empty"]),
    ([], ["prompt"]),
    ({"prompt_token_ids": []}, ["prompt", "empty"]),
    ([7] * MAX_MODEL_LEN, ["max_model_len=64", "at least one token"]),
    ([7] * (MAX_MODEL_LEN + 10), ["max_model_len=64"]),
    ([7, 10 ** 6], ["out of vocabulary"]),
])
def test_bad_prompts(llm, prompt, words):
    with pytest.raises(ValueError) as e:
        llm.generate(["fine prompt", prompt], GOOD, use_tqdm=False)   # the good one is withdrawn too
    for w in words: assert w in str(e.value), str(e.value)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.engine_core.scheduler.get_num_unfinished_requests() == 0
    assert len(llm.generate("hello", GOOD, use_tqdm=False)) == 1


def test_longest_allowed_prompt(llm):
    out = llm.generate({"prompt_token_ids": [7] * (MAX_MODEL_LEN - 1)}, SamplingParams(max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_running_requests_survive_a_bad_request(llm):
    engine = llm.llm_engine
    engine.add_request("ok", "hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", "", GOOD)
    bad = SamplingParams()
    bad.max_tokens = 0
    with pytest.raises(ValueError):
        engine.add_request("bad2", "x", bad)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(done[0].outputs[0].token_ids) == 8


def test_missing_model_folder():
    with pytest.raises(ValueError) as e:
        LLM("/no/such/model/folder")
    assert "model" in str(e.value)


def test_unsupported_architecture(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    assert "MadeUpForCausalLM" in str(e.value) or "architecture" in str(e.value)


def test_greedy_is_argmax(llm):
    prompts = ["hello world", "the cat", {"prompt_token_ids": [5, 9, 13, 17]}]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                          use_tqdm=False)]
    variants = [SamplingParams(temperature=0, seed=s, top_k=k, top_p=p, max_tokens=8, ignore_eos=True)
                for s, k, p in [(1, 5, 0.5), (123, 0, 0.1), (None, 50, 1.0)]]
    variants.append(SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True, seed=7))
    variants.append(SamplingParams(temperature=0.7, top_k=1, max_tokens=8, ignore_eos=True))
    for sp in variants:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == base, sp


# Values that used to reach the engine and kill it (EngineDeadError for every later call), or fail at
# serialization: each is now a ValueError naming the field, and the engine keeps serving.
ENGINE_KILLERS = [  # (kwargs, words the message must contain)
    (dict(min_tokens=2, stop_token_ids=[10 ** 8]), ["stop_token_ids", "out of vocabulary"]),
    (dict(stop_token_ids=[-3, 99999999]), ["stop_token_ids"]),
    (dict(min_tokens=2, stop_token_ids=[-1]), ["stop_token_ids"]),
    (dict(logit_bias={10 ** 6: 1.0}), ["logit_bias", "out of vocabulary"]),
    (dict(logprobs=100000), ["logprobs", "max allowed: 20"]),
    (dict(prompt_logprobs=100000), ["prompt_logprobs", "max allowed: 20"]),
    (dict(logprobs=21), ["logprobs", "max allowed: 20"]),
    (dict(seed=2 ** 64, temperature=1.0), ["seed"]),
]


@pytest.mark.parametrize("kwargs,words", ENGINE_KILLERS)
def test_engine_killers_are_rejected(llm, kwargs, words):
    with pytest.raises(ValueError) as e:
        llm.generate("hello", SamplingParams(max_tokens=3, **kwargs), use_tqdm=False)
    for w in words: assert w in str(e.value), str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("hello", GOOD, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_largest_allowed_logprobs_and_seed(llm):
    out = llm.generate("hello", SamplingParams(temperature=1.0, seed=2 ** 64 - 1, max_tokens=2, logprobs=20, prompt_logprobs=20),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and len(out.outputs[0].logprobs[0]) >= 20


def test_max_logprobs_flag(ckpt):
    small = LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN, max_logprobs=2)
    try:
        with pytest.raises(ValueError, match="max allowed: 2"):
            small.generate("hello", SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
        assert small.generate("hello", SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0].outputs[0].logprobs
    finally:
        small.llm_engine.shutdown()


def test_logit_bias_bans_and_forces(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = llm.generate("hello world", sp, use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                        logit_bias={base[0]: -100}), use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != base[0] and base[0] not in banned
    forced = llm.generate(["hello world", "the cat"], [SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True,
                                                                      logit_bias={11: 100}), sp], use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [11, 11, 11]
    assert forced[1].outputs[0].token_ids == llm.generate("the cat", sp, use_tqdm=False)[0].outputs[0].token_ids


def test_offline_validation_gaps():
    for kw, word in [(dict(stop=["x"], detokenize=False), "detokenize"), (dict(max_tokens="5"), "max_tokens"),
                     (dict(max_tokens=2.5), "max_tokens"), (dict(temperature="0.5"), "temperature")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kw)


@pytest.mark.parametrize("prompts", [None, 5, 2.5, [None], object()])
def test_generate_says_what_a_prompt_may_be(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, GOOD, use_tqdm=False)
    assert len(llm.generate("hello", GOOD, use_tqdm=False)) == 1


@pytest.mark.parametrize("argv,words", [
    (["generate", "hi", "--device", "tpu"], ["--device", "invalid choice"]),
    (["generate", "hi", "--kv-cache-memory-bytes", "-1"], ["kv_cache_memory_bytes must be > 0"]),
    (["generate", "hi", "--dtype", "int8"], ["--dtype", "invalid choice"]),
    (["serve", "--dtype", "int8"], ["--dtype", "invalid choice"]),
    (["generate", "hi", "--compilation-config", '{"cudagraph_mode": 7}'],
     ["cudagraph_mode must be one of ['NONE', 'PIECEWISE', 'FULL', 'FULL_DECODE_ONLY', 'FULL_AND_PIECEWISE']", "got 7"]),
    (["generate", "hi", "--compilation-config", '{"cudagraph_capture_sizes": ["a"]}'],
     ["cudagraph_capture_sizes must be a list of ints >= 1", "['a']"]),
    (["generate", "hi", "--compilation-config", '{"max_cudagraph_capture_size": 0}'],
     ["max_cudagraph_capture_size must be an int >= 1", "got 0"]),
    (["generate", "hi", "--compilation-config", '{"custom_ops": 5}'], ["custom_ops must be a list"]),
])
def test_cli_bad_flags_give_one_error_line(argv, words, capsys):
    "Each bad flag: exit status 2 and one `error:` line naming it, no traceback."
    from minivllm.entrypoints.cli.main import main
    try: rc = main(argv)
    except SystemExit as e: rc = e.code   # argparse choice errors exit from the parser
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    for w in words: assert w in err, err


def test_cli_dtype_choices_are_one_list():
    from minivllm.config import DTYPE_CHOICES
    from minivllm.entrypoints.cli.main import make_parser
    parser, _ = make_parser()
    for cmd in ("generate", "chat", "serve"):
        sub = parser._subparsers._group_actions[0].choices[cmd]
        assert tuple(next(a for a in sub._actions if a.dest == "dtype").choices) == DTYPE_CHOICES
    assert set(DTYPE_CHOICES) == {"auto", "half", "float16", "bfloat16", "float", "float32"}


def test_too_small_kv_cache_says_what_to_raise(ckpt):
    with pytest.raises(ValueError) as e:
        LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=1000, device="cpu")
    assert "--kv-cache-memory-bytes (at least" in str(e.value) and "gpu_memory_utilization" not in str(e.value)


@pytest.mark.parametrize("name,value,words", [
    ("MINIVLLM_CPU_ONEDNN_GEMM", "false", ["MINIVLLM_CPU_ONEDNN_GEMM='false': must be 0, 1"]),
    ("MINIVLLM_CPU_OPS", "off", ["MINIVLLM_CPU_OPS='off': must be 0, 1"]),
    ("MINIVLLM_CPU_ATTENTION", "2", ["MINIVLLM_CPU_ATTENTION='2': must be 0, 1"]),
    ("MINIVLLM_MAX_IMAGE_PIXELS", "lots", ["MINIVLLM_MAX_IMAGE_PIXELS='lots': must be an int >= 1"]),
])
def test_cli_bad_environment_gives_one_error_line(ckpt, name, value, words, monkeypatch, capsys):
    "A switch outside its allowed values stops the CLI before the model loads: exit 2, one `error:` line."
    from minivllm.entrypoints.cli.main import main
    monkeypatch.setenv(name, value)
    rc = main(["generate", "hi", "--model", ckpt, "--max-tokens", "1", "--max-model-len", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    for w in words: assert w in err, err
