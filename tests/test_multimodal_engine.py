"""Multimodal end to end on the tiny Gemma 3 vision-language checkpoint: greedy tokens equal transformers'
`Gemma3ForConditionalGeneration` (float32) for 0, 1 and 2 images, with chunked prefill cutting at the images and
without, with pan-and-scan crops; the prefix cache tells images apart; the encoder runs once per image while its
output is cached; the processor cache skips the HF processor; the process split's lru receiver cache; bad inputs
refused before the engine."""
import base64
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PAS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}


def image(seed: int, size=(32, 32)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def prompt_for(n: int) -> str:
    return "<bos>Look" + "".join(f" at <start_of_image> number {i}" for i in range(n)) + " and say"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(ckpt)


def hf_greedy(hf, prompt, images, n=6, **kw):
    model, proc = hf
    if images:
        inputs = proc(text=[prompt], images=[images], return_tensors="pt", **kw)
    else:
        inputs = proc(text=[prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def engine_core(llm):
    return llm.llm_engine.engine_core.engine_core


def runner(llm):
    return engine_core(llm).model_executor.driver_worker.model_runner


def generate(llm, prompt, images, params=GREEDY):
    item = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    return llm.generate(item, params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def llm_chunked(ckpt):  # 10 tokens per step: prompts are cut before each image
    return LLM(ckpt, dtype="float32", block_size=4, max_num_batched_tokens=10)


@pytest.mark.parametrize("n_images", [0, 1, 2])
@pytest.mark.parametrize("which", ["llm", "llm_chunked"])
def test_greedy_matches_transformers(request, hf, n_images, which):
    llm = request.getfixturevalue(which)
    images = [image(10 + i) for i in range(n_images)]
    out = generate(llm, prompt_for(n_images), images)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt_for(n_images), images)


def test_chunked_prefill_never_splits_an_image(llm_chunked):
    """Gemma 3 is a prefix-LM for images: the scheduler cuts each chunk before an image instead of inside it."""
    core = engine_core(llm_chunked)
    windows = []
    original = core.scheduler.schedule

    def spy():
        so = original()
        for rid, n in so.num_scheduled_tokens.items():
            req = core.scheduler.requests[rid]
            windows.append((req.num_computed_tokens - n, req.num_computed_tokens, [f.mm_position for f in req.mm_features]))
        return so

    core.scheduler.schedule = spy
    try:
        generate(llm_chunked, prompt_for(2), [image(1), image(2)])
    finally:
        core.scheduler.schedule = original
    cuts = 0
    for lo, hi, positions in windows:
        for pos in positions:
            assert not (lo < pos.offset < hi < pos.offset + pos.length), (lo, hi, pos.offset, pos.length)
            cuts += hi == pos.offset
    assert cuts >= 1  # at least one chunk really stopped right before an image


def test_pan_and_scan_matches_transformers(ckpt, hf):
    llm = LLM(ckpt, dtype="float32", block_size=4, mm_processor_kwargs=PAS)
    wide = image(5, size=(96, 32))
    out = generate(llm, prompt_for(1), [wide])
    feature = out.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>"))
    assert feature == 4 * 4  # the image plus 3 crops, 4 tokens each
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt_for(1), [wide], **PAS)


def test_prefix_cache_tells_images_apart(llm):
    llm.reset_prefix_cache()
    a, b = image(100), image(101)
    prompt = prompt_for(1)
    first = generate(llm, prompt, [a])
    image_start = first.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids("<start_of_image>"))
    other = generate(llm, prompt, [b])
    again = generate(llm, prompt, [a])
    assert other.num_cached_tokens <= image_start  # no block that holds the image is shared
    assert again.num_cached_tokens > image_start + 4  # the same image: the blocks over it hit
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(other.outputs[0].token_ids) != list(first.outputs[0].token_ids)


def test_encoder_runs_once_per_cached_image(ckpt):
    """Without prefix caching every prompt token is recomputed, but the image's encoder output is reused from
    the encoder cache (a freeable entry taken back); the processor cache also skips the HF processor."""
    llm = LLM(ckpt, dtype="float32", block_size=4, enable_prefix_caching=False)
    r = runner(llm)
    img = image(7)
    outs = [generate(llm, prompt_for(1), [img]) for _ in range(2)]
    assert r.num_encoder_runs == 1
    assert llm.llm_engine.input_processor.mm_processor.num_hf_calls == 1
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    generate(llm, prompt_for(1), [image(8)])
    assert r.num_encoder_runs == 2
    manager = engine_core(llm).scheduler.encoder_cache_manager
    assert all(not users for users in manager.cached.values())  # nothing in use once the requests ended
    assert len(manager.freeable) == 2


def test_shared_image_in_one_batch_is_encoded_once(ckpt, hf):
    llm = LLM(ckpt, dtype="float32", block_size=4, enable_prefix_caching=False)
    img = image(9)
    items = [{"prompt": prompt_for(1) + " " + w, "multi_modal_data": {"image": [img]}} for w in ("one", "two", "three")]
    outs = llm.generate(items, GREEDY, use_tqdm=False)
    assert runner(llm).num_encoder_runs == 1
    for item, out in zip(items, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, item["prompt"], [img])


def test_process_split_lru_cache_sends_tensors_once(ckpt, hf, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(ckpt, dtype="float32", block_size=4)
    try:
        img = image(11)
        ref = hf_greedy(hf, prompt_for(1), [img])
        outs = [generate(llm, prompt_for(1), [img]) for _ in range(3)]
        cache = llm.llm_engine.input_processor.mm_processor.cache
        assert type(cache).__name__ == "MultiModalProcessorSenderCache"
        assert (cache.stats.queries, cache.stats.hits) == (3, 2)  # data sent once, then None twice
        assert all(list(o.outputs[0].token_ids) == ref for o in outs)
    finally:
        llm.llm_engine.engine_core.shutdown()


def _transparent(mode: str) -> Image.Image:
    "Image 14's left half opaque, its right half fully transparent (hidden colour: the noise), in `mode`."
    rgb = np.asarray(image(14))
    alpha = np.zeros(rgb.shape[:2], np.uint8)
    alpha[:, :16] = 255
    if mode == "LA":
        return Image.fromarray(np.dstack([rgb[..., 0], alpha]), "LA")
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_transparent_images_match_transformers(llm, hf, mode):
    """Transparency is composited onto white, as transformers' processor does (vLLM's `convert_image_mode`):
    a plain `convert("RGB")` fed the transparent pixels' hidden colour instead, and the tokens differed."""
    img = _transparent(mode)
    for sent in (img, _png_bytes_image(img)):  # in memory, and decoded from a file's bytes (the server's path)
        out = generate(llm, prompt_for(1), [sent])
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt_for(1), [img])


def _png_bytes_image(img: Image.Image):
    from minivllm.multimodal.utils import load_image_bytes

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return load_image_bytes(buf.getvalue())


def test_chat_with_data_url_image(llm, hf):
    img = image(12)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, text, [Image.open(io.BytesIO(buf.getvalue())).convert("RGB")])


def test_bad_multimodal_inputs_are_refused(ckpt, llm):
    img = image(13)
    with pytest.raises(ValueError, match="has 0 <start_of_image> marker"):
        generate(llm, "<bos>no marker here", [img])
    with pytest.raises(ValueError, match="expected a PIL.Image.Image"):
        generate(llm, prompt_for(1), ["cat.png"])
    small = LLM(ckpt, dtype="float32", block_size=4, max_num_batched_tokens=5)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens=5"):
        generate(small, prompt_for(1), [img])
    text_ckpt = make_tiny_checkpoint("llama", os.path.join(os.path.dirname(ckpt), "llama"))
    with pytest.raises(ValueError, match="does not take images"):
        generate(LLM(text_ckpt, dtype="float32"), "<start_of_image>", [img])
    assert list(generate(llm, prompt_for(1), [img]).outputs[0].token_ids)  # the engine still serves


def test_logprobs_match_transformers_with_images(llm, hf):
    """Logprobs of the greedy tokens equal transformers' to 1e-4: this also sees the bidirectional image
    attention, which the greedy tokens of a random tiny model may not (the model-level tests check logits)."""
    model, proc = hf
    images = [image(20), image(21)]
    prompt = prompt_for(2)
    llm.reset_prefix_cache()
    out = generate(llm, prompt, images, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    inputs = proc(text=[prompt], images=[images], return_tensors="pt")
    with torch.no_grad():
        res = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    comp = out.outputs[0]
    for step, token in enumerate(comp.token_ids):
        ref = torch.log_softmax(res.logits[step][0].float(), -1)[token].item()
        assert abs(comp.logprobs[step][token].logprob - ref) < 1e-4, (step, comp.logprobs[step][token].logprob, ref)


def test_tensor_parallel_2_with_an_image_equals_1(ckpt, llm):
    """The SigLIP tower and the projector under TP=2 (worker processes, gloo): logprobs equal TP=1's. A
    first version reshaped the sharded QKV output with the full head count and crashed the engine."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    images = [image(30)]
    llm.reset_prefix_cache()
    ref = generate(llm, prompt_for(1), images, params).outputs[0]
    tp = LLM(ckpt, dtype="float32", block_size=4, tensor_parallel_size=2)
    try:
        out = generate(tp, prompt_for(1), images, params).outputs[0]
    finally:
        tp.llm_engine.shutdown()
    assert list(out.token_ids) == list(ref.token_ids)
    for step, token in enumerate(ref.token_ids):
        assert abs(out.logprobs[step][token].logprob - ref.logprobs[step][token].logprob) < 1e-4


def test_chat_image_errors_name_the_part(ckpt, llm):
    text_llm = LLM(make_tiny_checkpoint("llama", os.path.join(os.path.dirname(ckpt), "llama-chat")), dtype="float32")
    with pytest.raises(ValueError, match="does not take images"):
        text_llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(1)}]}], GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].image_pil: expected a PIL.Image.Image"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": "cat.png"}]}], GREEDY)
    with pytest.raises(ValueError, match="unsupported content part type 'image'"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": image(1)}]}], GREEDY)
