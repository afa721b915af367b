"""Gemma 3 vision-language model (`Gemma3ForConditionalGeneration`) against transformers, float32, CPU.

A tiny random-weight checkpoint (`make_tiny_checkpoint("gemma3_mm")`: 2 text layers, sliding + full; SigLIP on
32x32 crops, 4 soft tokens per crop) and its own `AutoProcessor`. Prompts with 0, 1 and 2 images (random
PIL pixels) and one with pan-and-scan crops run through minivllm's model over a paged KV cache
(`PagedModelHarness`): `embed_multimodal` -> `embed_input_ids(..., is_multimodal=)` -> `forward` with
`mm_prefix_range` (each run of image soft tokens attends both ways), a prefill whole or split at an image
boundary, then greedy decode steps. Logits and tokens must equal transformers' full-sequence forward with
`token_type_ids` (its bidirectional image mask), for the torch reference and the CPU kernel backend, and
with a sliding window shorter than an image. Without `mm_prefix_range` the image prompts' logits differ.
"""

import numpy as np
import PIL.Image
import pytest
import torch
import transformers

from minivllm.config import DeviceConfig, ModelConfig, VllmConfig
from minivllm.model_executor.model_loader import get_model
from minivllm.testing import PagedModelHarness, make_tiny_checkpoint

NEW_TOKENS = 4
# transformers' Gemma3ForConditionalGeneration never soft-caps its logits (its text-only Gemma3ForCausalLM
# does; vLLM's and minivllm's both do); real Gemma 3 checkpoints have no cap, so neither do these.
NO_CAP = {"final_logit_softcapping": None}


def random_image(seed, width, height):
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat(n_images, text):
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


# name -> (number of images, text, image sizes, processor kwargs)
PROMPTS = {
    "text": (0, "What is the capital of France?", [], {}),
    "one_image": (1, "What is in the picture?", [(40, 30)], {}),
    "two_images": (2, "Which of the two is brighter?", [(30, 50), (64, 64)], {}),
    # a 2.2:1 image of >= 256-pixel crops: the original plus two pan-and-scan crops, three soft-token runs
    "pan_and_scan": (1, "Describe it.", [(640, 288)], {"do_pan_and_scan": True}),
}


def image_runs(ids, image_token_id):
    "[(start, end)] of each maximal run of image soft tokens in `ids` (end exclusive)."
    runs, start = [], None
    for p, t in enumerate(ids + [-1]):
        if t == image_token_id and start is None:
            start = p
        elif t != image_token_id and start is not None:
            runs.append((start, p))
            start = None
    return runs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("gemma3_mm"), **NO_CAP)


@pytest.fixture(scope="module")
def inputs(ckpt):
    proc = transformers.AutoProcessor.from_pretrained(ckpt)
    out = {}
    for name, (n, text, sizes, kwargs) in PROMPTS.items():
        prompt = proc.apply_chat_template(chat(n, text), add_generation_prompt=True, tokenize=False)
        images = [random_image(i + 7 * len(out), w, h) for i, (w, h) in enumerate(sizes)] or None
        enc = proc(text=prompt, images=images, return_tensors="pt", **kwargs)
        if images:  # the processor drops num_crops; the image processor reports it
            crops = proc.image_processor(images, return_tensors="pt", **kwargs).get("num_crops")
            enc["num_patches"] = 1 + (
                crops if crops is not None else torch.zeros(len(images), dtype=torch.long)
            )
        out[name] = enc
    assert out["pan_and_scan"]["num_patches"].tolist() == [3]
    assert out["two_images"]["pixel_values"].shape[0] == 2
    return out


def hf_greedy(hf, enc, steps=NEW_TOKENS):
    "Greedy tokens and the logits before each, by full-sequence forwards (no cache)."
    ids, tt = enc["input_ids"], enc["token_type_ids"]
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            out = hf(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                token_type_ids=tt,
                pixel_values=enc.get("pixel_values"),
            )
            last = out.logits[0, -1].float()
            logits.append(last)
            tokens.append(int(last.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
            tt = torch.cat([tt, torch.zeros(1, 1, dtype=tt.dtype)], 1)
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(hf_model, inputs):
    return {name: hf_greedy(hf_model, enc) for name, enc in inputs.items()}


def load_ours(path, backend, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", backend)
    return get_model(VllmConfig(ModelConfig(path, dtype="float32"), device_config=DeviceConfig("cpu")))


def ours_greedy(model, enc, split=None, use_ranges=True, steps=NEW_TOKENS, block_size=4):
    """Prefill (in chunks at the `split` positions), then greedy decode steps over a paged cache; returns the
    tokens and the logits before each."""
    ids = enc["input_ids"][0].tolist()
    image_id = model.config.image_token_id
    is_mm = enc["input_ids"][0] == image_id
    with torch.no_grad():
        mm = ()
        if "pixel_values" in enc:
            mm = model.embed_multimodal(enc["pixel_values"], enc["num_patches"])
            assert [e.shape[0] for e in mm] == [4 * int(n) for n in enc["num_patches"]]
        flat = torch.cat(mm) if mm else None
    ranges = {"r": image_runs(ids, image_id)} if use_ranges else None
    harness = PagedModelHarness(model, block_size=block_size, num_blocks=64)
    bounds = [0, *(split or []), len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        chunk_mm = is_mm[a:b]
        done = int(is_mm[:a].sum())
        parts = [flat[done : done + int(chunk_mm.sum())]] if flat is not None else None
        with torch.no_grad():
            emb = model.embed_input_ids(torch.tensor(ids[a:b]), parts, is_multimodal=chunk_mm)
        logits = harness.step({"r": ids[a:b]}, inputs_embeds=emb, mm_prefix_range=ranges)
    tokens, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        logits = harness.step({"r": [tokens[-1]]}, mm_prefix_range=ranges)
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("backend", ["TORCH_REF", "CPU_ATTN"])
def test_greedy_equals_transformers(ckpt, inputs, expected, backend, monkeypatch):
    model = load_ours(ckpt, backend, monkeypatch)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    for name, enc in inputs.items():
        tokens, logits = ours_greedy(model, enc)
        want_tokens, want_logits = expected[name]
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4, msg=f"{backend} {name}")
        assert tokens == want_tokens, f"{backend} {name}"


def test_chunked_prefill_at_image_boundaries(ckpt, inputs, expected, monkeypatch):
    "A prefill split just before an image run, just after one, and between two images' runs."
    model = load_ours(ckpt, "CPU_ATTN", monkeypatch)
    for name in ("one_image", "two_images", "pan_and_scan"):
        enc = inputs[name]
        runs = image_runs(enc["input_ids"][0].tolist(), model.config.image_token_id)
        for split in ([runs[0][0]], [runs[0][1]], [runs[0][0], runs[-1][1]]):
            tokens, logits = ours_greedy(model, enc, split=split)
            torch.testing.assert_close(logits, expected[name][1], atol=2e-4, rtol=1e-4, msg=f"{name} {split}")
            assert tokens == expected[name][0], f"{name} split at {split}"


def test_mask_matters(ckpt, inputs, expected, monkeypatch):
    "Without mm_prefix_range the image tokens attend causally and the logits move away from transformers'."
    model = load_ours(ckpt, "TORCH_REF", monkeypatch)
    for name in ("one_image", "two_images"):
        _, logits = ours_greedy(model, inputs[name], use_ranges=False, steps=1)
        assert (logits[0] - expected[name][1][0]).abs().max() > 1e-2, name
    _, logits = ours_greedy(model, inputs["text"], use_ranges=False, steps=1)  # text: no difference
    torch.testing.assert_close(logits[0], expected["text"][1][0], atol=2e-4, rtol=1e-4)


def test_sliding_window_shorter_than_an_image(tmp_path, inputs, monkeypatch):
    """Window 3 < the 4-token image run: transformers ANDs the window over (causal OR same image), so the last
    image token does not see the first; the reference and kernel backends agree with it."""
    path = make_tiny_checkpoint("gemma3_mm", tmp_path / "w3", sliding_window=3, **NO_CAP)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.text_config.sliding_window == 3
    enc = inputs["two_images"]
    want_tokens, want_logits = hf_greedy(hf, enc, steps=2)
    for backend in ("TORCH_REF", "CPU_ATTN"):
        model = load_ours(path, backend, monkeypatch)
        tokens, logits = ours_greedy(model, enc, steps=2)
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4, msg=backend)
        assert tokens == want_tokens, backend
