"""The embedded default model: GGUF -> Hugging Face conversion, caching, and equality with transformers' GGUF model.

The conversion runs once per machine (into $MINIVLLM_CACHE_DIR or ~/.cache/minivllm), so after the first
run these tests reuse the cached folder; the GGUF comparison loads the GGUF file with transformers each time.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from minivllm.transformers_utils import embedded
from minivllm.transformers_utils.embedded import get_default_model_path, get_embedded_gguf_path, resolve_model


def test_resolve_model_local_folder_and_hub_id(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="local folder.*never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_interrupted_conversion_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    calls = []

    def broken(gguf_path, out_dir):
        calls.append(out_dir)
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed half-way

    monkeypatch.setattr(embedded, "convert_gguf_to_hf", broken)
    with pytest.raises(KeyboardInterrupt):
        get_default_model_path()
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists() and list(tmp_path.iterdir()) == []

    def fake(gguf_path, out_dir):
        calls.append(out_dir)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
            (Path(out_dir) / f).write_text("{}")

    monkeypatch.setattr(embedded, "convert_gguf_to_hf", fake)
    path = get_default_model_path()
    assert path == str(tmp_path / "SmolLM2-135M-Instruct") and len(calls) == 2
    assert get_default_model_path() == path and len(calls) == 2  # second call: no conversion
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct"]  # no temp folder left


@pytest.fixture(scope="module")
def default_path():
    return get_default_model_path()


def test_converted_checkpoint_layout(default_path):
    from transformers import AutoConfig, AutoTokenizer
    p = Path(default_path)
    assert resolve_model(None) == default_path == resolve_model("default")
    config = AutoConfig.from_pretrained(p)
    assert config.architectures == ["LlamaForCausalLM"] and config.dtype == torch.bfloat16 and config.tie_word_embeddings
    assert "quantization_config" not in json.loads((p / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(p)
    assert tok.convert_ids_to_tokens(tok("12345").input_ids) == list("12345")  # digits split one by one
    assert "<|im_start|>assistant" in json.loads((p / "tokenizer_config.json").read_text())["chat_template"]
    gen = json.loads((p / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id == 2 and gen["bos_token_id"] == 1


@pytest.mark.slow  # 22 s; the embedded model's chat equals transformers in test_llm_equivalence.py
def test_greedy_matches_transformers_gguf_model(default_path):
    "Our model on the converted folder (float32, paged path) generates what transformers' GGUF-loaded model does."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from minivllm.config import DeviceConfig, ModelConfig, VllmConfig
    from minivllm.model_executor.model_loader import get_model
    from minivllm.testing import PagedModelHarness
    tok = AutoTokenizer.from_pretrained(default_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    gguf = get_embedded_gguf_path()
    with embedded._cached_gguf_name_map():
        ref_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    del ref_model
    ours = get_model(VllmConfig(ModelConfig(default_path, dtype="float32"), device_config=DeviceConfig("cpu")))
    h = PagedModelHarness(ours, block_size=16, num_blocks=16)
    out, logits = [], h.step({"r": ids})
    for _ in range(8):
        out.append(logits.argmax(-1).item())
        if out[-1] == tok.eos_token_id: break
        logits = h.step({"r": [out[-1]]})
    assert out == ref[:len(out)], (tok.decode(out), tok.decode(ref))
    print(repr(tok.decode(out)))
