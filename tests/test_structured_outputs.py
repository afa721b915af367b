"""Structured outputs end to end (offline `LLM`): JSON schemas, regexes and choices constrain the output.

The JSON checks use the embedded SmolLM2-135M-Instruct (a random model would rarely close its braces), float32;
regex and choice use a tiny random checkpoint: a constraint must hold whatever the model would like to say.
"""
import json
import re

import jsonschema
import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.testing import make_tiny_checkpoint

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "pets", "address"],
    "additionalProperties": False,
}
PEOPLE = ["a pirate", "a chef", "a pilot", "a child", "a poet", "a nurse", "a farmer", "a judge", "a diver", "a monk"]


@pytest.fixture(scope="module")
def smol():
    llm = LLM(dtype="float32", max_model_len=1024)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    llm = LLM(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama")), dtype="float32", max_model_len=256)
    yield llm
    llm.llm_engine.shutdown()


def _chat(llm, people, params):
    convs = [[{"role": "user", "content": f"Describe {p} as a JSON object with name, age, colour, pets and address."}]
             for p in people]
    return [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]


# sampled (0.8) takes 30 s on a 2-core CPU: `-m slow`; greedy stays in the default suite
@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])
def test_json_schema_outputs_validate(smol, temperature):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=160, structured_outputs=so)
    for out in _chat(smol, PEOPLE, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_parses(smol):
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=256, structured_outputs=so)
    convs = [[{"role": "user", "content": f"Give {p}'s name and age as a JSON object."}] for p in PEOPLE[:4]]
    outs = [o.outputs[0] for o in smol.chat(convs, params, use_tqdm=False)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 2, [o.text for o in outs]  # a free-form object may run past max_tokens
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:  # every output, finished or cut, starts an object
        assert out.text.startswith("{")


def test_regex_and_choice_hold_on_a_random_model(tiny):
    regex = SamplingParams(temperature=0.9, seed=1, max_tokens=24,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    choice = SamplingParams(temperature=0.9, seed=2, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]))
    prompts = [f"prompt {i}" for i in range(6)]
    for out in tiny.generate(prompts, regex, use_tqdm=False):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.outputs[0].text), out.outputs[0].text
    for out in tiny.generate(prompts, choice, use_tqdm=False):
        assert out.outputs[0].text in ("yes", "no", "maybe so"), out.outputs[0].text
    # an unconstrained request in the same batch is unaffected
    free = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    mixed = tiny.generate(["p0", "p1"], [regex, free], use_tqdm=False)
    alone = tiny.generate(["p1"], free, use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_bad_constraint_is_refused_up_front(tiny):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(ValueError, match="structured_outputs.json: .*#/properties/a: `type` 'nope'"):
        tiny.generate("hi", bad, use_tqdm=False)
    uncompilable = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}))
    with pytest.raises(ValueError, match="structured_outputs.json: cannot compile"):
        tiny.generate("hi", uncompilable, use_tqdm=False)
    assert tiny.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
