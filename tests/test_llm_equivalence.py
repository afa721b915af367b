"""End-to-end greedy equality with Hugging Face transformers (float32, CPU).

Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints from `minivllm.testing`, a batch of mixed-length prompts
with different `max_tokens`, run through `LLM.generate` under several engine settings (default, chunked prefill,
prefix caching off, a KV pool small enough to force preemption): every setting must give transformers' tokens.
Also: the embedded SmolLM2-135M-Instruct on 4 chat prompts x 32 tokens, and the prefix-cache hit size.
"""
import random

import pytest
import torch
import transformers

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint

ARCHS = ["llama", "qwen2", "qwen3"]
NUM_PROMPTS = 10


def _prompts(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [3, 7, 12, 18, 25, 33, 41, 50, 64, 5][:NUM_PROMPTS]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    max_tokens = [4 + (i * 3) % 13 for i in range(NUM_PROMPTS)]
    return prompts, max_tokens


def hf_greedy(model, prompt_ids, max_new_tokens):
    "transformers' greedy `generate`, never stopping on EOS (the engine runs with ignore_eos)."
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def load_hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # run to max_new_tokens, like ignore_eos
    return model


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    model = load_hf(path)
    prompts, max_tokens = _prompts(model.config.vocab_size)
    with torch.no_grad():
        expected = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    return request.param, path, prompts, max_tokens, expected


def run_minivllm(path, prompts, max_tokens, **engine_kwargs):
    llm = LLM(path, dtype="float32", max_model_len=256, **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


SETTINGS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "long_prefill_threshold": dict(long_prefill_token_threshold=8, max_num_seqs=3),
    # the default runs the fused CPU kernels of RMSNorm / SiluAndMul / RoPE (minivllm_kernels.cpu_ops); this is the torch code
    "no_custom_ops": dict(compilation_config={"custom_ops": ["none"]}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_equals_transformers(case, setting):
    arch, path, prompts, max_tokens, expected = case
    _, got = run_minivllm(path, prompts, max_tokens, **SETTINGS[setting])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{arch}/{setting}: prompt {i} (len {len(prompts[i])}) differs: {g} vs {e}"


def test_preemption_gives_same_tokens(case):
    arch, path, prompts, max_tokens, expected = case
    # 12 blocks of 16 tokens: the longest request (64 + 16 tokens) fits alone, the batch does not
    llm, got = run_minivllm(path, prompts, max_tokens, num_gpu_blocks_override=12, max_num_batched_tokens=64)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.num_preemptions > 0, "the KV pool was meant to be too small for the batch"
    assert got == expected
    assert scheduler.kv_cache_manager.usage == 0.0


def test_prefix_cache_hit_size(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=16)
    prompt = {"prompt_token_ids": list(range(10, 47))}   # L = 37
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == ((37 - 1) // 16) * 16 == 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_smollm2_chat_equals_transformers():
    embedded = pytest.importorskip("minivllm.transformers_utils.embedded")
    path = str(embedded.resolve_model(None))
    llm = LLM(path, dtype="float32", max_model_len=512)
    tok = llm.get_tokenizer()
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about the sea.", "What is 12 times 12?"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    model = load_hf(path)
    for q, out in zip(questions, outs):
        with torch.no_grad():
            expected = hf_greedy(model, out.prompt_token_ids, 32)
        assert out.outputs[0].token_ids == expected, f"{q!r}: {tok.decode(out.outputs[0].token_ids)!r} vs {tok.decode(expected)!r}"
    assert "Paris" in outs[0].outputs[0].text


def test_hybrid_gemma3_with_preemption(tmp_path):
    "Two KV cache groups (sliding window 8 + full): chunked prefill and preemption still give transformers' tokens."
    path = make_tiny_checkpoint("gemma3", tmp_path / "gemma3")
    model = load_hf(path)
    prompts, max_tokens = _prompts(model.config.vocab_size, seed=1)
    prompts, max_tokens = prompts[:6], max_tokens[:6]
    with torch.no_grad():
        expected = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    llm, got = run_minivllm(path, prompts, max_tokens, num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=24)
    assert got == expected
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
