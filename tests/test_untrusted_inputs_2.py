"""Untrusted inputs, second pass (issue 29's attacker check): one client's images must not stall the server
for everyone else (decoding and the Hugging Face processor run off the event loop, so `/health` keeps being
answered while a prompt's images are processed), and a grammar or schema with no finite output (it recurses
forever, yet allows a token at every step) is a 400 instead of a run to max_tokens.

In-process servers (as in test_server.py) on tiny random-weight checkpoints."""

import threading
import time

import openai
import pytest
from test_server import Server
from test_untrusted_inputs import _fine, data_url, images_message, small_png

from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from minivllm.engine.arg_utils import EngineArgs

    ckpt = make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm-untrusted-2"))
    args = EngineArgs(model=ckpt, dtype="float32", block_size=4, max_model_len=128)
    srv = Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))
    yield srv
    srv.stop()


def test_health_is_answered_while_images_are_processed(vlm, monkeypatch):
    """The image processor is held inside a request until `/health` has answered: on the event loop's thread
    (as before) `/health` could not answer, the hold times out after 20 s and the flag stays False."""
    processor = vlm.llm.input_processor
    inside, release, seen = threading.Event(), threading.Event(), {}
    original = processor._process_multimodal

    def held(prompt):
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            inside.set()
            seen["released_by_health"] = release.wait(20)
        return original(prompt)

    monkeypatch.setattr(processor, "_process_multimodal", held)
    result = {}

    def chat():
        messages = images_message([data_url(small_png(7))])
        result["response"] = vlm.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0
        )

    worker = threading.Thread(target=chat)
    worker.start()
    assert inside.wait(60), "the image request never reached the processor"
    assert vlm.get("/health") is not None
    release.set()
    worker.join(60)
    assert seen["released_by_health"], "/health waited for the image processor (it ran on the event loop)"
    assert result["response"].choices[0].finish_reason == "length"
    assert vlm.client.models.list().data[0].id == "tiny"  # still serving


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    "The tiny Llama behind the server, with xgrammar."
    pytest.importorskip("xgrammar")
    from minivllm.engine.arg_utils import EngineArgs

    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-untrusted-2"))
    srv = Server(
        AsyncLLM.from_engine_args(EngineArgs(model=ckpt, max_model_len=512), enable_multiprocessing=False)
    )
    yield srv
    srv.stop()


SELF_REQUIRING = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= x\nx ::= "b" x | "c" x'}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SELF_REQUIRING},
                }
            },
            "response_format",
        ),
    ],
)
def test_constraint_with_no_finite_output_is_a_400(real, extra, param):
    "These ran to max_tokens (200, finish_reason=length, 112 characters of `a`s at 50 tokens on SmolLM2)."
    with pytest.raises(openai.BadRequestError) as e:
        real.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Go"}], max_tokens=50, extra_body=extra
        )
    assert e.value.body["param"] == param, e.value.body
    assert "no output can ever complete the constraint" in e.value.body["message"], e.value.body
    _fine(real)


def test_recursive_constraint_that_can_end_is_served(real):
    "The same recursion with a way out (`c` optional) is served, and its output parses."
    schema = {**SELF_REQUIRING, "$defs": {"n": {**SELF_REQUIRING["$defs"]["n"], "required": []}}}
    out = real.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Go"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("limit", ['{"video": 2}', '{"audio": 1, "image": 2}'])
def test_limit_for_a_modality_the_model_cannot_take_is_refused(vlm, limit):
    "`--limit-mm-per-prompt '{\"video\": 2}'` on an image-only model started and ignored it; vLLM refuses it."
    from minivllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=vlm.llm.model_config.model, limit_mm_per_prompt=limit)
    with pytest.raises(
        ValueError, match=r"limit_mm_per_prompt\['(video|audio)'\].*at most 0 (video|audio) items"
    ):
        args.create_engine_config()


def test_client_leaving_while_its_images_are_processed_does_not_poison_the_cache(vlm, monkeypatch):
    """A client that leaves while its images are processed: the processor has already marked the images as
    sent to the engine's cache, so the request must still reach the engine (and be aborted there). Dropped
    instead, the next request with the same image was rejected ('sent without data and is not in the
    receiver cache')."""
    processor = vlm.llm.input_processor
    inside, release = threading.Event(), threading.Event()
    original = processor._process_multimodal

    def held(prompt):
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") and not release.is_set():
            inside.set()
            release.wait(30)
        return original(prompt)

    monkeypatch.setattr(processor, "_process_multimodal", held)
    messages = images_message([data_url(small_png(11))])
    impatient = vlm.client.with_options(timeout=1.0, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert inside.wait(30)
    release.set()
    vlm.wait_idle()
    again = vlm.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason == "length"
    vlm.wait_idle()


def test_client_leaving_while_its_add_waits_for_the_engine_does_not_poison_the_cache(vlm):
    """The same once the images are processed: the add of the request waits for the engine core's thread
    (busy with a step: held here), and the client leaves. The cancellation dropped the queued add, so the
    engine never received the images the processor cache had marked as sent, and the next request with the
    same image was refused ('sent without data'; found by a clean-clone CI run on a loaded machine). Now
    the add is sent anyway and aborted after it."""
    held, release = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(30)

    messages = images_message([data_url(small_png(13))])
    vlm.engine.engine_thread.submit(hold)  # the engine core's one thread: the next add queues behind it
    try:
        assert held.wait(30)
        impatient = vlm.client.with_options(timeout=1.0, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        time.sleep(0.5)  # the server sees the disconnect and cancels the handler while its add is queued
    finally:
        release.set()
    vlm.wait_idle()
    again = vlm.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason == "length"
    vlm.wait_idle()
