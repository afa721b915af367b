"""Lone UTF-16 surrogates given to `LLM.generate` (break pass 16, item 1): a surrogate in `lora_name` or
`cache_salt` (multiprocess engine, the default) raised a bare `UnicodeEncodeError` when the request was sent
to the engine process, and the next plain `generate()` never returned: the request stayed registered in the
front end though it was never sent. Surrogates in a regex, choice, schema or grammar, or in the prompt, gave
errors naming no field. Now each is a ValueError naming the field before anything is registered (chapters
02 and 25), and a request the engine core cannot be sent is forgotten (chapter 29b `_send_or_forget`).
"""

import os
import threading

import pytest

from minivllm import LLM, SamplingParams
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.testing import make_tiny_checkpoint

S = "\ud800"
SP = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    "A multiprocess LLM (the default; tests/conftest.py keeps others in-process), LoRA enabled."
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    saved = os.environ.get("MINIVLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        llm = LLM(path, dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=8, max_loras=1)
    finally:
        os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = saved or "0"
    yield llm
    llm.llm_engine.shutdown()


def _generate_within(llm: LLM, seconds: float = 60) -> list[int]:
    "`llm.generate` of a plain prompt, failing the test (not hanging it) past `seconds`."
    out = []
    t = threading.Thread(
        target=lambda: out.append(llm.generate([[1, 2, 3]], SP, use_tqdm=False)), daemon=True
    )
    t.start()
    t.join(seconds)
    assert out, f"the next generate() did not return within {seconds} s"
    return out[0][0].outputs[0].token_ids


BAD = {
    "lora_request.lora_name": lambda llm: llm.generate(
        "hi", SP, use_tqdm=False, lora_request=LoRARequest("n" + S, 1, "/nonexistent")
    ),
    "cache_salt": lambda llm: llm.generate({"prompt": "hi", "cache_salt": "s" + S}, SP, use_tqdm=False),
    "structured_outputs": lambda llm: llm.generate(
        "hi",
        SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a" + S)),
        use_tqdm=False,
    ),  # fmt: skip
    "prompt": lambda llm: llm.generate({"prompt_token_ids": [1, 2], "prompt": "x" + S}, SP, use_tqdm=False),
}


@pytest.mark.parametrize("field", list(BAD))
def test_a_surrogate_is_a_value_error_naming_the_field_and_the_engine_serves_on(llm, field):
    expected = _generate_within(llm)
    with pytest.raises(ValueError, match=f"{field}: the text holds a lone UTF-16 surrogate"):
        BAD[field](llm)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate_within(llm) == expected


def test_a_request_the_engine_core_cannot_be_sent_is_forgotten(llm, monkeypatch):
    "Whatever fails the send (here a stand-in error), nothing stays registered and the next call returns."
    expected = _generate_within(llm)
    core = llm.llm_engine.engine_core

    def refuse(request):
        raise UnicodeEncodeError("utf-8", "x", 0, 1, "a stand-in for a value msgpack cannot encode")

    monkeypatch.setattr(core, "add_request", refuse)
    with pytest.raises(UnicodeEncodeError):
        llm.generate([[4, 5, 6]], SamplingParams(max_tokens=2, n=2), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate_within(llm) == expected
