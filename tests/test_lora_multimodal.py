"""LoRA on the tiny Gemma 3 vision-language checkpoint (issue 32, item 4): adapters on the language model's
projections, greedy tokens with an image equal transformers' `Gemma3ForConditionalGeneration` + peft
(`PeftModel`, float32) per adapter, mixed with the base model in one batch. The image identifier (encoder
cache and prefix-cache key) is the image's hash for every adapter, so one encoder output serves them all,
unless `enable_tower_connector_lora` is on: then vLLM's `_get_mm_identifier` prefixes it with the adapter's
name and each adapter encodes the image for itself. An adapter naming a vision-tower module is refused."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

peft = pytest.importorskip("peft", reason="the LoRA reference is peft's PeftModel (pip install peft)")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.lora.request import LoRARequest  # noqa: E402
from minivllm.testing import make_tiny_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# the language model's seven projections (a regex: peft would match the vision tower's names too)
LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


PROMPT = "<bos>Look at <start_of_image> and say"


def _hf_model(ckpt):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def _hf_greedy(model, proc, img):
    inputs = proc(text=[PROMPT], images=[[img]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoProcessor

    root = tmp_path_factory.mktemp("lora_mm")
    ckpt = make_tiny_checkpoint("gemma3_mm", root / "base")
    proc = AutoProcessor.from_pretrained(ckpt)
    img = image(3)
    expected = {None: _hf_greedy(_hf_model(ckpt), proc, img)}
    adapters = {}
    for i, (name, rank) in enumerate([("a4", 4), ("b8", 8)]):
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=LM_TARGETS, lora_dropout=0.0, init_lora_weights=False
        )
        torch.manual_seed(20 + i)
        pm = peft.get_peft_model(_hf_model(ckpt), config)
        with torch.no_grad():  # make the update clearly visible in the tiny model's tokens
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(3.0)
        pm.save_pretrained(root / name)
        adapters[name] = LoRARequest(name, i + 1, str(root / name))
        expected[name] = _hf_greedy(pm.eval(), proc, img)
        assert expected[name] != expected[None], f"adapter {name} does not change the tokens"
    return ckpt, root, img, adapters, expected


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def _generate(llm, img, loras):
    items = [{"prompt": PROMPT, "multi_modal_data": {"image": [img]}} for _ in loras]
    outs = llm.generate(items, GREEDY, use_tqdm=False, lora_request=list(loras))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_adapter_names_are_the_language_models(setup):
    "peft names the tensors after transformers' layout; minivllm reads them as the text model's modules."
    _, root, *_ = setup
    from safetensors import safe_open

    with safe_open(str(root / "a4" / "adapter_model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert names and all(".language_model." in n for n in names), names[:3]
    assert not any("vision_tower" in n for n in names)


@pytest.mark.parametrize("tower", [False, True])
def test_mixed_adapters_with_an_image_equal_peft(setup, tower):
    """Both adapters and the base model in one batch, the same image: tokens equal peft per adapter. The
    encoder cache holds one output for all (identifier = hash) or one per adapter and one for the base model
    (identifier = name:hash, enable_tower_connector_lora)."""
    ckpt, _, img, adapters, expected = setup
    llm = LLM(
        ckpt,
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        enable_tower_connector_lora=tower,
    )
    names = [None, "a4", "b8", "a4"]
    got = _generate(llm, img, [adapters[n] if n else None for n in names])
    for name, g in zip(names, got):
        assert g == expected[name], (name, g, expected[name])
    runner = _runner(llm)
    cached = set(llm.llm_engine.engine_core.engine_core.scheduler.encoder_cache_manager.cached)
    (mm_hash,) = [i for i in cached if ":" not in i]
    assert cached == ({mm_hash, f"a4:{mm_hash}", f"b8:{mm_hash}"} if tower else {mm_hash})
    assert all(name.startswith("language_model.") for name in runner.lora_manager.adapter_manager.modules)
    processor = llm.llm_engine.input_processor
    assert processor.mm_processor.num_hf_calls == 1  # the processor cache is keyed by mm_hash, shared


def test_identifier_prefixed_with_the_adapter_name(setup):
    "_get_mm_identifier on real requests: `name:hash` with tower / connector LoRA, the hash without."
    ckpt, _, img, adapters, _ = setup
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": [img]}}
    ids = {}
    for tower in (False, True):
        llm = LLM(ckpt, dtype="float32", enable_lora=True, max_lora_rank=8, enable_tower_connector_lora=tower)
        processor = llm.llm_engine.input_processor
        for name in (None, "a4"):
            req = processor.process_inputs(
                f"r-{tower}-{name}", prompt, GREEDY, lora_request=adapters.get(name)
            )
            (feature,) = req.mm_features
            ids[tower, name] = (feature.identifier, feature.mm_hash)
    print(json.dumps({f"{k[0]}/{k[1]}": v for k, v in ids.items()}, indent=1))
    mm_hash = ids[False, None][1]
    assert all(h == mm_hash for _, h in ids.values())  # the processor-cache key never changes
    assert ids[False, None][0] == ids[False, "a4"][0] == ids[True, None][0] == mm_hash
    assert ids[True, "a4"][0] == f"a4:{mm_hash}"


def test_vision_tower_adapter_is_refused(setup, tmp_path):
    "An adapter on the vision tower (tower LoRA is not implemented) is a ValueError naming target_modules."
    ckpt, *_ = setup
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*vision_tower.*\.(q_proj|out_proj|fc1)")
    peft.get_peft_model(_hf_model(ckpt), config).save_pretrained(tmp_path / "tower")
    llm = LLM(ckpt, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="target_modules"):
        _generate(llm, image(1), [LoRARequest("tower", 9, str(tmp_path / "tower"))])
