"""Images and grammars from clients as untrusted input (issue 29), through the real server and the official
`openai` client: decompression bombs are refused by their declared size before decoding (the server's peak
RSS is measured), image parts are counted against the per-prompt limit before any is decoded, the default
limit, JSON-schema features xgrammar cannot enforce are 400s, a grammar that allows no token never runs to
max_tokens, masked-token logprobs serialise, and JSON whitespace is bounded.

In-process servers (as in test_server.py) on tiny random-weight checkpoints; each request is a few tokens."""

import base64
import ctypes
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


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure may read low, never high
        pass


class PeakRSS:
    "Growth of this process's peak RSS (VmHWM, reset by /proc/self/clear_refs) over its RSS at entry, in MB."

    def __enter__(self):
        _trim_heap()  # freed memory glibc still holds would absorb new allocations without raising the peak
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

    args = EngineArgs(model=ckpt, dtype="float32", block_size=4, max_model_len=128, **kw)
    return Server(AsyncLLM.from_engine_args(args, enable_multiprocessing=False))


@pytest.fixture(scope="module")
def vlm(gemma_ckpt):
    "The tiny Gemma 3 with no --limit-mm-per-prompt: the default (128 // 10 positions an image = 12) applies."
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


@needs_rss
def test_accepted_images_are_decoded_one_at_a_time(vlm):
    "Eight different 16-megapixel images (just under the limit) cost one image's decoding, not eight."
    urls = [data_url(png_bomb(4096, 4096 - i)) for i in range(8)]  # distinct: no processor-cache hit
    _still_serves(vlm)
    with PeakRSS() as rss:
        r = vlm.client.chat.completions.create(
            model="tiny", messages=images_message(urls), max_completion_tokens=2
        )
    assert r.choices[0].finish_reason == "length"
    # held decoded, the eight take 8 x 64 MB on top of one image's processing (~330 MB): about 840 MB
    assert rss.peak_mb < 600, rss.peak_mb


def test_only_common_raster_formats_are_opened(vlm):
    "EPS would make Pillow run Ghostscript (where installed), SVG it cannot read: 400s naming the part."
    for raw in (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",
        b'<svg xmlns="http://www.w3.org/2000/svg"/>',
    ):
        body = _bad_request(vlm, images_message([data_url(raw)]))
        assert (
            "messages[0].content[0].image_url: not a valid image (not one of PNG, JPEG" in body["message"]
        ), body


def test_default_per_prompt_limit(vlm):
    """An image of the tiny checkpoint takes 10 prompt positions (4 soft tokens, 2 markers, 4 newlines, as
    its tokenizer spells them): 12 fit in max_model_len 128. The estimate was 4 + 2 = 6 (21 images)."""
    from minivllm.multimodal.processing import get_num_tokens_per_image

    assert get_num_tokens_per_image(vlm.llm.model_config) == 10
    urls = [data_url(small_png(i)) for i in range(13)]
    body = _bad_request(vlm, images_message(urls))
    assert body["param"] == "messages"
    assert (
        "13 image(s) in one prompt; at most 12 are allowed "
        "(each takes at least 10 of max_model_len 128 tokens)"
    ) in body["message"], body
    # the count is refused before any image is decoded: 13 parts that are not images get the same answer
    junk = images_message(["data:image/png;base64,@@@"] * 13)
    assert "13 image(s) in one prompt; at most 12" in _bad_request(vlm, junk)["message"]
    r = vlm.client.chat.completions.create(
        model="tiny", messages=images_message(urls[:2]), max_completion_tokens=2
    )
    assert r.choices[0].finish_reason == "length"


# ---- grammars: constraints xgrammar cannot enforce, dead ends, logprobs, whitespace ----

CHAT = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-untrusted"))


@pytest.fixture(scope="module")
def real(llama_ckpt):
    pytest.importorskip("xgrammar")
    from minivllm.engine.arg_utils import EngineArgs

    srv = Server(
        AsyncLLM.from_engine_args(
            EngineArgs(model=llama_ckpt, max_model_len=512), enable_multiprocessing=False
        )
    )
    yield srv
    srv.stop()


def _fine(srv):
    assert (
        srv.client.completions.create(model="tiny", prompt="still fine", max_tokens=2)
        .choices[0]
        .finish_reason
    )


def _schema_fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


UNENFORCEABLE = [
    ({"not": {}}, "#: `not` is ignored"),
    (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "string"}}},
            ]
        },
        "`allOf` with more than one schema",
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2},
        "`uniqueItems` is ignored",
    ),
    (
        {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}},
        "#/properties/n: `multipleOf`",
    ),
    ({"type": "string", "pattern": "a$b"}, "a $ that is not at the end"),
]


@pytest.mark.parametrize("schema, why", UNENFORCEABLE)
def test_constraints_xgrammar_cannot_enforce_are_400s(real, schema, why):
    with pytest.raises(openai.BadRequestError) as e:
        real.client.chat.completions.create(
            model="tiny", messages=CHAT, max_completion_tokens=4, response_format=_schema_fmt(schema)
        )
    assert e.value.body["param"] == "response_format"
    assert "xgrammar cannot enforce" in e.value.body["message"] and why in e.value.body["message"], (
        e.value.body
    )
    with pytest.raises(openai.BadRequestError) as e:
        real.client.completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"json": schema}}
        )
    assert e.value.body["param"] == "structured_outputs" and why in e.value.body["message"]
    _fine(real)


def test_regex_with_an_empty_language_is_refused_at_once(real):
    with pytest.raises(openai.BadRequestError) as e:
        real.client.completions.create(
            model="tiny", prompt="x", max_tokens=200, extra_body={"structured_outputs": {"regex": r"[^\s\S]"}}
        )
    assert e.value.body["param"] == "structured_outputs"
    assert "matches no output at all" in e.value.body["message"]
    _fine(real)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_grammar_dead_end_ends_at_once_with_an_error(real, stream, logprobs):
    "`a[^\\s\\S]`: an `a`, then nothing may follow. It used to run to max_tokens (and with logprobs: a 500)."
    kw = dict(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=200,
        stream=stream,
        extra_body={"structured_outputs": {"regex": r"a[^\s\S]"}},
    )
    if logprobs:
        kw.update(logprobs=True, top_logprobs=3)
    if not stream:
        with pytest.raises(openai.BadRequestError) as e:
            real.client.chat.completions.create(**kw)
        body = e.value.body
    else:
        chunks = []
        with pytest.raises(openai.APIError) as e:  # the error arrives in-band, as an SSE event
            for c in real.client.chat.completions.create(**kw):
                chunks.append(c)
        body = e.value.body
        assert (
            sum(len(c.choices) and bool(c.choices[0].delta.content) for c in chunks) <= 1
        )  # at most the `a`
    assert body["param"] == "structured_outputs", body
    assert "after 1 generated token(s) the constraint allows no next token" in body["message"], body
    _fine(real)


def test_dead_end_offline_is_finish_reason_error(llama_ckpt):
    pytest.importorskip("xgrammar")
    from minivllm import LLM, SamplingParams
    from minivllm.sampling_params import StructuredOutputsParams

    llm = LLM(llama_ckpt, max_model_len=128)
    try:
        params = SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(regex=r"ab[^\s\S]"))
        out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.llm_engine.shutdown()
    assert out.finish_reason == "error", out
    assert len(out.token_ids) <= 2 and "allows no next token" in out.stop_reason, out


def test_logprobs_of_masked_tokens_serialise_as_the_floor(real):
    "The grammar allows 2-3 tokens; the other top logprobs are -inf in the engine and -9999.0 on the wire."
    r = real.client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["ab", "cd"]}},
    )
    tops = [t.logprob for c in r.choices[0].logprobs.content for t in c.top_logprobs]
    assert -9999.0 in tops and all(-9999.0 <= t <= 0.0 for t in tops), tops
    r = real.client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=4,
        logprobs=5,
        extra_body={"structured_outputs": {"choice": ["ab", "cd"]}},
    )
    assert -9999.0 in [v for step in r.choices[0].logprobs.top_logprobs for v in step.values()]


def _whitespace_bias(srv) -> dict[str, float]:
    "+100 on every whitespace-only token: where the grammar allows whitespace, the model emits it."
    tok = srv.llm.tokenizer
    ids = [i for i in range(len(tok)) if (t := tok.decode([i])) and not t.strip()]
    assert ids
    return {str(i): 100.0 for i in ids}


@pytest.mark.parametrize(
    "fmt",
    [
        _schema_fmt({"type": "array", "items": {"type": "integer"}, "minItems": 3}),
        {"type": "json_object"},
    ],
)
def test_json_whitespace_is_bounded(real, fmt):
    from minivllm.v1.structured_output.backend_xgrammar import MAX_JSON_WHITESPACE

    r = real.client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=60,
        temperature=0,
        response_format=fmt,
        logit_bias=_whitespace_bias(real),
    )
    text = r.choices[0].message.content
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*("|$)', '""', text)  # whitespace inside a string is content
    runs = [len(m) for m in re.findall(r"\s+", outside_strings)]
    assert runs and max(runs) <= MAX_JSON_WHITESPACE, (runs, text)
    assert len(text.strip()) > 1, text  # something besides whitespace and the opening bracket
    compact = real.client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=30,
        temperature=0,
        logit_bias=_whitespace_bias(real),
        extra_body={
            "structured_outputs": {
                "json": {"type": "array", "items": {"type": "integer"}},
                "disable_any_whitespace": True,
            }
        },
    )
    assert max((len(m) for m in re.findall(r"\s+", compact.choices[0].message.content)), default=0) <= 1


# ---- a second attacker's pass: empty / malformed keywords, empty choice, inexact formats ----

MALFORMED = [
    ({"anyOf": []}, "#: `anyOf` is an empty array; JSON Schema requires at least one entry"),  # was 200, ''
    ({"type": []}, "#: `type` is an empty array"),  # was any JSON
    ({"type": "strng"}, "`type` 'strng': each type must be one of array, boolean, integer"),
    (
        {"type": "object", "minProperties": 2},  # xgrammar: "... additional properties aren't allowed"
        "`minProperties` 2 asks for more properties than `properties` defines (0): schemas compile in "
        "strict mode, where an object without `additionalProperties` holds only the properties it names",
    ),
    ({"type": "string", "format": "hostname"}, "string format 'hostname' is not enforced exactly"),
    ({"type": "string", "format": "ipv4", "pattern": "^1$"}, "`pattern` beside `format`"),
    ({"type": "string", "maxLength": -1}, "`maxLength` must be a non-negative integer; got -1"),  # was ignored
    ({"type": "object", "required": "a"}, "`required` must be a list of property names"),  # was ignored
    ({"type": "string", "pattern": 5}, "`pattern` must be a string; got 5"),  # was a C++ type assertion
]


@pytest.mark.parametrize("schema, why", MALFORMED)
def test_malformed_schemas_are_400s_naming_the_keyword(real, schema, why):
    with pytest.raises(openai.BadRequestError) as e:
        real.client.chat.completions.create(
            model="tiny", messages=CHAT, max_completion_tokens=4, response_format=_schema_fmt(schema)
        )
    assert e.value.body["param"] == "response_format", e.value.body
    assert why in e.value.body["message"], e.value.body
    assert "/project/" not in e.value.body["message"]  # no C++ log prefix
    _fine(real)


def test_empty_choice_is_a_400_naming_the_field(real):
    with pytest.raises(openai.BadRequestError) as e:
        real.client.completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"choice": []}}
        )
    assert e.value.body["param"] == "structured_outputs", e.value.body
    assert "structured_outputs.choice: choice must have at least one entry" in e.value.body["message"]
    assert "EBNF" not in e.value.body["message"]
    _fine(real)


def _bias_towards(srv, texts: list[str]) -> dict[str, float]:
    "+100 on the single tokens spelling each of `texts`: the model emits them wherever the grammar allows."
    tok = srv.llm.tokenizer
    ids = [i for i in range(len(tok)) if tok.decode([i]) in texts]
    assert ids, texts
    return {str(i): 100.0 for i in ids}


def test_ipv4_format_refuses_leading_zeros(real):
    """Pushed towards `0` everywhere, xgrammar's own ipv4 grammar would let `00`/`030` octets through; the exact
    pattern minivllm substitutes allows a `0` octet only alone."""
    import ipaddress

    r = real.client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=40,
        temperature=0,
        logit_bias=_bias_towards(real, ["0", "00", "000", "03", "030"]),
        response_format=_schema_fmt({"type": "string", "format": "ipv4"}),
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    value = __import__("json").loads(choice.message.content)
    assert str(ipaddress.IPv4Address(value)) == value, value  # canonical: no leading zeros
    r = real.client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=40,
        temperature=0,
        logit_bias=_bias_towards(real, ["3", "0", "30", "03"]),
        response_format=_schema_fmt({"type": "string", "format": "date"}),
    )
    import datetime

    value = __import__("json").loads(r.choices[0].message.content)
    datetime.date.fromisoformat(value)  # a real day (xgrammar alone allows 30 and 31 in every month)


def test_placeholder_text_from_clients_is_refused_with_or_without_images(vlm):
    """`<start_of_image>` typed by a client: it was accepted without an image (an image marker with no image
    behind it) and a 400 with one. Now one rule: message text holding an image placeholder is a 400 naming the
    message, both ways; a raw prompt's markers must match its images, zero included."""
    for text in ("look: <start_of_image>", "an <end_of_image> here", "<image_soft_token>"):
        no_image = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        with_image = images_message([data_url(small_png(1))])
        with_image[0]["content"][-1]["text"] = text
        for messages in (no_image, with_image):
            body = _bad_request(vlm, messages)
            assert body["param"] == "messages", body
            assert "stands for an image in this model's prompts" in body["message"], body
            assert "content[" in body["message"].split(":")[0], body  # names the part
    body = _bad_request(vlm, [{"role": "user", "content": "plain string <start_of_image>"}])
    assert body["message"].startswith("messages[0].content: contains <start_of_image>"), body
    with pytest.raises(openai.BadRequestError) as e:
        vlm.client.completions.create(model="tiny", prompt="x <start_of_image> y", max_tokens=2)
    assert "prompt: has 1 <start_of_image> but no image" in e.value.body["message"], e.value.body
    ok = vlm.client.completions.create(model="tiny", prompt="start of image", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    _still_serves(vlm)
