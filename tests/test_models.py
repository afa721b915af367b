"""Our models on the paged path (TorchRef backend) against transformers, on tiny random checkpoints.

Each case builds a checkpoint with `minivllm.testing.make_tiny_checkpoint`, loads it with `get_model`, and
runs it step by step with `PagedModelHarness` (KV cache per layer, hand-built `CommonAttentionMetadata`,
`set_forward_context`). Every step's logits must equal transformers' last-token logits on the full sequence
(float32, tight tolerance) and greedy next tokens must agree.
"""
import pytest
import torch

from minivllm.config import DeviceConfig, ModelConfig, VllmConfig
from minivllm.model_executor.model_loader import get_model
from minivllm.testing import PagedModelHarness, make_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {
    "llama": ("llama", {}),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    # layer 0 full attention, layers 1-2 a window of 8: two KV cache groups, window masks in prefill and decode
    "qwen2_swa": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3}),
    "qwen3": ("qwen3", {}),
}
ATOL = 1e-4


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    arch, overrides = CASES[request.param]
    ckpt = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), seed=3, **overrides)
    ours = get_model(VllmConfig(ModelConfig(ckpt, dtype="float32"), device_config=DeviceConfig("cpu")))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return ours, hf


def hf_last_logits(hf, tokens):
    with torch.no_grad(): return hf(torch.tensor([tokens])).logits[0, -1]


def check_step(hf, logits, seqs):
    ref = torch.stack([hf_last_logits(hf, s) for s in seqs.values()])
    err = (logits - ref).abs().max().item()
    assert err < ATOL, f"max |ours - transformers| = {err}"
    assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_prefill_then_decode_matches_transformers(models):
    ours, hf = models
    g = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    seqs = {f"r{i}": torch.randint(3, vocab, (n,), generator=g).tolist() for i, n in enumerate([7, 19, 3, 33])}
    h = PagedModelHarness(ours, block_size=16, num_blocks=64)
    scheduled = {r: list(s) for r, s in seqs.items()}
    logits = h.step(scheduled)  # all four prompts prefilled in one batch
    check_step(hf, logits, seqs)
    late = torch.randint(3, vocab, (11,), generator=g).tolist()
    for step in range(4):
        nxt = dict(zip(scheduled, logits.argmax(-1).tolist()))
        scheduled = {r: [t] for r, t in nxt.items()}
        for r, t in nxt.items(): seqs[r] = seqs[r] + [t]
        if step == 1:  # a mixed step: four decodes and a new prompt's prefill
            seqs["late"], scheduled["late"] = late, list(late)
        logits = h.step(scheduled)
        check_step(hf, logits, {r: seqs[r] for r in scheduled})


def test_chunked_prefill_matches_transformers(models):
    ours, hf = models
    g = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    prompt = torch.randint(3, vocab, (40,), generator=g).tolist()
    other = torch.randint(3, vocab, (5,), generator=g).tolist()
    h = PagedModelHarness(ours, block_size=16, num_blocks=32, seed=1)
    first = h.step({"long": prompt[:21], "other": other})  # chunk 1 (not block aligned) + another prompt
    check_step(hf, first, {"long": prompt[:21], "other": other})
    t = first[1].argmax().item()
    logits = h.step({"long": prompt[21:], "other": [t]})  # chunk 2 reads chunk 1 from the cache; other decodes
    check_step(hf, logits, {"long": prompt, "other": other + [t]})
    t2 = logits[0].argmax().item()
    check_step(hf, h.step({"long": [t2]}), {"long": prompt + [t2]})


def test_dummy_run_matches_single_prompt(models):
    "attn_metadata=None (profiling) is causal attention over the given tokens: one prompt's hidden states."
    from minivllm.forward_context import set_forward_context
    ours, hf = models
    ids = torch.arange(3, 20)
    with torch.no_grad(), set_forward_context(None):
        logits = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    assert (logits - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_runs_close_to_float32(arch, tmp_path):
    "The bf16 path (bf16 weights and KV cache) stays within bf16 rounding of the float32 logits."
    ckpt = make_tiny_checkpoint(arch, tmp_path, seed=3)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        model = get_model(VllmConfig(ModelConfig(ckpt, dtype=dtype), device_config=DeviceConfig("cpu")))
        assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
        h = PagedModelHarness(model, block_size=16, num_blocks=16)
        first = h.step({"a": list(range(5, 30)), "b": [7, 8, 9]})
        logits[dtype] = torch.cat([first, h.step({"a": [3], "b": [4]})])
        assert logits[dtype].dtype == torch.float32
    assert (logits["float32"] - logits["bfloat16"]).abs().max().item() < 0.15
