"""Prefix-cache hits on the embedded model: a cached system-prompt block changes nothing in float32, and in
bfloat16 moves a logit by about one bfloat16 step only.

Regression for a report of "wrong greedy answer after a prefix-cache hit" (bfloat16, CPU_ATTN): two sampled
"Hi" chats cache the chat template's first block, then the greedy France chat answered "L'Étoile..." instead of
"The capital of France is Paris.". The cache held the right K/V: the kernel's attention over it equals a float32
recomputation from the cache, and float32 gives identical tokens. The first token is a near-tie ('The' -1.83 vs
'L' -1.96 in bfloat16), and attending the cached block with the C kernel instead of SDPA over the prompt's own
K/V rounds differently by about one bfloat16 step of the logits (0.125 at their magnitude), which flips it.
"""
import pytest

from minivllm import LLM, SamplingParams


def _chat(tok, q: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)


def _france_after_hi(dtype: str, enable_prefix_caching: bool):
    llm = LLM(dtype=dtype, enable_prefix_caching=enable_prefix_caching, max_model_len=1024)
    try:
        tok = llm.get_tokenizer()
        for i, n in enumerate((3, 4)):  # sampled chats: they compute (and cache) the template's first block
            llm.generate([_chat(tok, "Hi")], SamplingParams(max_tokens=n, temperature=1.0, seed=i), use_tqdm=False)
        out = llm.generate([_chat(tok, "What is the capital of France?")],
                           SamplingParams(max_tokens=8, temperature=0, logprobs=3), use_tqdm=False)[0]
        return out.outputs[0], out.num_cached_tokens
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # 23 s on a 2-core AVX2 CPU; prefix caching's token equality stays in test_llm_equivalence.py
def test_cached_prefix_is_exact_in_float32():
    cached, n_cached = _france_after_hi("float32", True)
    fresh, n_fresh = _france_after_hi("float32", False)
    assert n_cached >= 16 and n_fresh == 0  # the hit really happened, and only with prefix caching
    assert cached.token_ids == fresh.token_ids
    for a, b in zip(cached.logprobs, fresh.logprobs):
        for tid, lp in a.items():
            assert abs(lp.logprob - b[tid].logprob) < 2e-3


@pytest.mark.slow  # 30 s on a 2-core CPU
def test_cached_prefix_moves_bfloat16_logits_by_about_one_step():
    cached, n_cached = _france_after_hi("bfloat16", True)
    fresh, _ = _france_after_hi("bfloat16", False)
    assert n_cached >= 16
    first_c, first_f = cached.logprobs[0], fresh.logprobs[0]
    shared = set(first_c) & set(first_f)
    assert len(shared) >= 2
    # bfloat16 logits of magnitude 16-32 are spaced 0.125 apart: allow two steps, no more.
    assert max(abs(first_c[t].logprob - first_f[t].logprob) for t in shared) <= 0.25
