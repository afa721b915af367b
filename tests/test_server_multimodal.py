"""The OpenAI server with a vision-language model: chat completions with `image_url` content parts (data URLs),
streamed and not, through the official `openai` client, equal to `LLM.chat`'s greedy tokens; bad images (not an
image, truncated, too large, an http URL, a file outside the allowed folder) are 400s naming the field, and the
server keeps serving; a text model refuses image parts."""
import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM
from test_server import Server, _real_engine


def png_url(seed: int, size=(32, 32)) -> tuple[str, bytes]:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), buf.getvalue()


def image_message(url, text="What is this?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm-srv"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def vlm(ckpt, media_dir):
    from minivllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=ckpt, dtype="float32", block_size=4, allowed_local_media_path=str(media_dir))
    srv = Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(ckpt):
    from minivllm import LLM

    return LLM(ckpt, dtype="float32", block_size=4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_image_matches_offline(vlm, reference, stream):
    from minivllm import SamplingParams

    url, _ = png_url(1)
    kw = dict(model="tiny", messages=image_message(url), max_completion_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in vlm.client.chat.completions.create(stream=True, **kw))
    else:
        r = vlm.client.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.usage.prompt_tokens > 4  # the engine's count: the image's 4 placeholder tokens are in it
    offline = reference.chat(image_message(url), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0]
    assert text == offline.outputs[0].text


def test_file_url_under_the_allowed_folder(vlm, media_dir):
    url, raw = png_url(2)
    (media_dir / "img.png").write_bytes(raw)
    via_file = vlm.client.chat.completions.create(model="tiny", messages=image_message(f"file://{media_dir}/img.png"),
                                                  max_completion_tokens=4, temperature=0)
    via_data = vlm.client.chat.completions.create(model="tiny", messages=image_message(url), max_completion_tokens=4,
                                                  temperature=0)
    assert via_file.choices[0].message.content == via_data.choices[0].message.content


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a valid image"),
    ("truncated", "not a valid image"),
    ("https://example.com/cat.png", "not fetched"),
    ("file:///etc/passwd", "not inside the allowed local media path"),
    ("data:image/png;base64,%%%", "not valid base64"),
])
def test_bad_images_are_400s_naming_the_field(vlm, url, message):
    if url == "truncated":
        good, raw = png_url(3)
        url = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    with pytest.raises(openai.BadRequestError) as e:
        vlm.client.chat.completions.create(model="tiny", messages=image_message(url), max_completion_tokens=4)
    assert message in e.value.body["message"], e.value.body
    assert e.value.body["param"] == "messages"
    assert "messages[0].content[0].image_url" in e.value.body["message"]
    ok = vlm.client.chat.completions.create(model="tiny", messages=image_message(png_url(4)[0]), max_completion_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_too_large_image_is_a_400(vlm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_MAX_IMAGE_BYTES", "100")
    with pytest.raises(openai.BadRequestError) as e:
        vlm.client.chat.completions.create(model="tiny", messages=image_message(png_url(5)[0]), max_completion_tokens=2)
    assert "at most 100 are allowed" in e.value.body["message"]


def test_text_model_refuses_image_parts(tmp_path_factory):
    srv = Server(_real_engine(tmp_path_factory))
    try:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client.chat.completions.create(model="tiny", messages=image_message(png_url(6)[0]), max_completion_tokens=2)
        assert e.value.body["param"] == "messages"
    finally:
        srv.stop()
