"""Images and grammars from clients as untrusted input (issue 29), through the real server and the official
`openai` client: decompression bombs are refused by their declared size before decoding (the server's peak
RSS is measured), image parts are counted against the per-prompt limit before any is decoded, the default
limit, JSON-schema features xgrammar cannot enforce are 400s, a grammar that allows no token never runs to
max_tokens, masked-token logprobs serialise, and JSON whitespace is bounded.

In-process servers (as in test_server.py) on tiny random-weight checkpoints; each request is a few tokens."""

import base64
import io
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from test_server import Server

from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM

STATUS = Path("/proc/self/status")


def png_bomb(width: int, height: int) -> bytes:
    "A valid all-black 8-bit RGB PNG of width x height, compressed a block of rows at a time (never decoded)."

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    comp, row = zlib.compressobj(9), bytes(1 + 3 * width)  # filter byte 0 + the row's pixels
    rows_per = max(1, (1 << 20) // len(row))
    idat = (
        b"".join(comp.compress(row * min(rows_per, height - y)) for y in range(0, height, rows_per))
        + comp.flush()
    )
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def small_png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
        buf, "PNG"
    )
    return buf.getvalue()


def images_message(urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]


def _kb(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", STATUS.read_text(), re.M).group(1))


class PeakRSS:
    "Growth of this process's peak RSS (VmHWM, reset by /proc/self/clear_refs) over its RSS at entry, in MB."

    def __enter__(self):
        Path("/proc/self/clear_refs").write_text("5")  # peak := current
        self.start = _kb("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak_mb = (_kb("VmHWM") - self.start) / 1024
        self.left_mb = (_kb("VmRSS") - self.start) / 1024


def _can_measure_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return STATUS.exists()
    except OSError:
        return False


needs_rss = pytest.mark.skipif(
    not _can_measure_rss(), reason="needs Linux /proc/self/clear_refs (peak RSS reset)"
)


@pytest.fixture(scope="module")
def gemma_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm-untrusted"))


def _vlm(ckpt, **kw) -> Server:
    from minivllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=ckpt, dtype="float32", block_size=4, max_model_len=64, **kw)
    return Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))


@pytest.fixture(scope="module")
def vlm(gemma_ckpt):
    "The tiny Gemma 3 with no --limit-mm-per-prompt: the default (64 // (4 + 2) = 10 images) applies."
    srv = _vlm(gemma_ckpt)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vlm_limit2(gemma_ckpt):
    srv = _vlm(gemma_ckpt, limit_mm_per_prompt={"image": 2})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bomb():
    raw = png_bomb(12000, 12000)  # 144 megapixels: Pillow only warns (89 MP) and refuses at 179 MP
    assert len(raw) < 500_000
    return data_url(raw)


def _bad_request(srv, messages) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=2)
    return e.value.body


def _still_serves(srv):
    ok = srv.client.chat.completions.create(
        model="tiny", messages=images_message([data_url(small_png(0))]), max_completion_tokens=2
    )
    assert ok.choices[0].finish_reason == "length"


@needs_rss
def test_bomb_in_pillows_warning_range_is_refused_before_decoding(vlm, bomb):
    _still_serves(vlm)  # warm: the first image request loads the HF image processor
    with PeakRSS() as one:
        body = _bad_request(vlm, images_message([bomb]))
    assert body["param"] == "messages"
    assert (
        "messages[0].content[0].image_url: the image is 12000 x 12000 = 144000000 pixels" in body["message"]
    )
    assert "MINIVLLM_MAX_IMAGE_PIXELS" in body["message"]
    with PeakRSS() as eight:
        body = _bad_request(vlm, images_message([bomb] * 8))  # 3.4 MB of base64, 1.15 gigapixels declared
    assert "12000 x 12000" in body["message"]
    # decoding one takes 576 MB (Pillow keeps RGB as 4 bytes a pixel); the requests' own bytes are a few MB
    assert one.peak_mb < 150 and eight.peak_mb < 150, (one.peak_mb, eight.peak_mb)
    assert eight.left_mb < 100, eight.left_mb
    _still_serves(vlm)


@needs_rss
def test_eight_bombs_over_the_per_prompt_limit_are_not_decoded(vlm_limit2, bomb, monkeypatch):
    monkeypatch.setenv(
        "MINIVLLM_MAX_IMAGE_PIXELS", str(200_000_000)
    )  # the pixel limit would let them through
    with PeakRSS() as rss:
        body = _bad_request(vlm_limit2, images_message([bomb] * 8))
    assert body["param"] == "messages"
    assert (
        "messages: 8 image(s) in one prompt; at most 2 are allowed (--limit-mm-per-prompt)" in body["message"]
    )
    assert rss.peak_mb < 150, rss.peak_mb
    # garbage parts too: the count is checked before any part is even base64-decoded
    junk = images_message(["data:image/png;base64,@@@"] * 3)
    assert "3 image(s) in one prompt" in _bad_request(vlm_limit2, junk)["message"]
    _still_serves(vlm_limit2)


def test_default_per_prompt_limit(vlm):
    urls = [data_url(small_png(i)) for i in range(11)]
    body = _bad_request(vlm, images_message(urls))
    assert body["param"] == "messages"
    assert (
        "11 image(s) in one prompt; at most 10 are allowed (each takes at least 6 of max_model_len 64 tokens)"
    ) in body["message"], body
    r = vlm.client.chat.completions.create(
        model="tiny", messages=images_message(urls[:2]), max_completion_tokens=2
    )
    assert r.choices[0].finish_reason == "length"
