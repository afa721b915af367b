"""Untrusted inputs, second pass (issue 29's attacker check): one client's images must not stall the server
for everyone else. Decoding and the Hugging Face processor run off the event loop, so `/health` and other
requests keep being answered while a prompt's images are processed.

In-process server (as in test_server.py) on the tiny Gemma 3 vision-language checkpoint."""

import threading

import pytest
from test_server import Server
from test_untrusted_inputs import images_message, data_url, small_png

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
