"""Multi-LoRA serving (issue 32): greedy tokens equal transformers + peft (`PeftModel`, float32), per adapter.

Tiny random-weight Llama / Qwen2 / Qwen3 / Gemma 3 checkpoints (`minivllm.testing`) and three adapters built
here with `peft` (`init_lora_weights=False`: B is random, not zero, so an adapter really changes the
tokens): rank 4 on q/k/v/o, rank 8 on all seven projections, rank 8 on gate/up/down. Prompts are spread over
the three adapters and the base model in one batch; the same under chunked prefill, under preemption, with
fewer slots than adapters (LRU swapping from the host cache), with the torch reference kernel, and with
the KV cache invariant checker on. Prefix caching hits only within one adapter.
"""

import random

import pytest
import torch
import transformers

peft = pytest.importorskip("peft", reason="the LoRA reference is peft's PeftModel (pip install peft)")

from minivllm.entrypoints.llm import LLM  # noqa: E402
from minivllm.lora.request import LoRARequest  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.testing import make_tiny_checkpoint  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, target modules)
    "attn_r4": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all_r8": (8, 16, ALL),
    "mlp_r8": (8, 32, ["gate_proj", "up_proj", "down_proj"]),
}
NUM_PROMPTS = 8


def _prompts(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [3, 9, 17, 26, 5, 33, 12, 40][:NUM_PROMPTS]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths], [
        4 + (i * 3) % 7 for i in range(NUM_PROMPTS)
    ]


def _load_hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _make_adapter(base_path, out_dir, rank, alpha, targets, seed):
    "A peft LoRA adapter with random (non-zero) A and B, saved in PEFT's format; returns its PeftModel."
    model = _load_hf(base_path)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False
    )
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(model, config)
    with (
        torch.no_grad()
    ):  # init_lora_weights=False draws B around 0.02 scale; make the update clearly visible
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()


def _two_adapters(root) -> str:
    """A tiny llama in `root/base` and two rank-8 adapters of its attention projections, `root/a1` and
    `root/a2` (seeds 10 and 11: their greedy tokens differ); returns the base's path."""
    path = make_tiny_checkpoint("llama", root / "base")
    mods = ["q_proj", "k_proj", "v_proj", "o_proj"]
    _make_adapter(path, root / "a1", 8, 16, mods, seed=10)
    _make_adapter(path, root / "a2", 8, 16, mods, seed=11)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = make_tiny_checkpoint(request.param, root / "base")
    base = _load_hf(path)
    prompts, max_tokens = _prompts(base.config.vocab_size)
    loras, expected = {}, {None: [_greedy(base, p, m) for p, m in zip(prompts, max_tokens)]}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        pm = _make_adapter(path, root / name, rank, alpha, targets, seed=10 + i)
        loras[name] = LoRARequest(name, i + 1, str(root / name))
        expected[name] = [_greedy(pm, p, m) for p, m in zip(prompts, max_tokens)]
        assert expected[name] != expected[None], (
            f"adapter {name} does not change the tokens: the test could not fail"
        )
    return request.param, path, prompts, max_tokens, loras, expected


def _assignment():
    "Prompt i -> adapter name or None (the base model), all four in one batch."
    names = [None, *ADAPTERS]
    return [names[i % len(names)] for i in range(NUM_PROMPTS)]


def _run(path, prompts, max_tokens, lora_requests, **kwargs):
    kwargs = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 3, **kwargs}
    llm = LLM(path, dtype="float32", max_model_len=256, **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_requests
    )
    return llm, [o.outputs[0].token_ids for o in outs]


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def _check(case, got, assignment):
    arch, _, prompts, _, _, expected = case
    for i, (name, g) in enumerate(zip(assignment, got)):
        assert g == expected[name][i], (
            f"{arch}: prompt {i} (len {len(prompts[i])}) with adapter {name}: {g} vs {expected[name][i]}"
        )


def test_each_adapter_alone_equals_peft(case):
    arch, path, prompts, max_tokens, loras, expected = case
    llm = LLM(path, dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8, max_loras=1)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    for name, lora in loras.items():
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora
        )
        _check(case, [o.outputs[0].token_ids for o in outs], [name] * NUM_PROMPTS)


SETTINGS = {
    "mixed": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "torch_reference_kernel": dict(),  # MINIVLLM_LORA_KERNEL=torch, set below
}


# "mixed" for every model here; the other settings (5-8 s each on a 2-core CPU) in `make test-slow`
@pytest.mark.parametrize("setting", ["mixed", *(pytest.param(s, marks=pytest.mark.slow) for s in list(SETTINGS)[1:])])
def test_mixed_batch_equals_peft(case, setting, monkeypatch):
    "Three adapters and the base model in the same steps (max_loras=3 slots), token for token."
    monkeypatch.setenv("MINIVLLM_CHECK_INVARIANTS", "1")
    if setting == "torch_reference_kernel":
        monkeypatch.setenv("MINIVLLM_LORA_KERNEL", "torch")
    _, path, prompts, max_tokens, loras, _ = case
    assignment = _assignment()
    llm, got = _run(
        path, prompts, max_tokens, [loras[n] if n else None for n in assignment], **SETTINGS[setting]
    )
    _check(case, got, assignment)
    pw = _runner(llm).lora_manager.adapter_manager.punica_wrapper
    assert pw.kernel == ("torch" if setting == "torch_reference_kernel" else "cpu")


def test_preemption_equals_peft(case, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CHECK_INVARIANTS", "1")
    arch, path, prompts, max_tokens, loras, _ = case
    assignment = _assignment()
    llm, got = _run(
        path,
        prompts,
        max_tokens,
        [loras[n] if n else None for n in assignment],
        num_gpu_blocks_override=40 if arch == "gemma3" else 16,  # Gemma 3: two KV groups share the pool
        block_size=4,
        max_num_batched_tokens=32,
    )
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0, (
        "the KV pool was meant to be too small"
    )
    _check(case, got, assignment)


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (2, 3)])
def test_more_adapters_than_slots_swaps(case, max_loras, max_cpu_loras):
    "Three adapters through fewer slots (and host cache entries): LRU swapping, the same tokens."
    _, path, prompts, max_tokens, loras, _ = case
    assignment = _assignment()
    requests = [loras[n] if n else None for n in assignment]
    llm, got = _run(path, prompts, max_tokens, requests, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    _check(case, got, assignment)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    again = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=requests
    )
    _check(case, [o.outputs[0].token_ids for o in again], assignment)  # the adapters come back from the LRU
    worker_manager = _runner(llm).lora_manager
    if max_cpu_loras < len(ADAPTERS):  # the host cache unloads: some adapter is read from disk twice
        assert worker_manager.num_loads > len(ADAPTERS)
    else:  # all cached on the host; the slots swap
        assert worker_manager.num_loads == len(ADAPTERS)
        assert worker_manager.adapter_manager.num_evictions > 0


def _graph_replays(llm) -> int:
    "Decode steps that ran on a CPU graph: replays plus the captures made in a step (all but the first)."
    entries = _runner(llm).cudagraphs.values()
    return sum(e.cudagraphs[0].num_replays for e in entries) + max(len(entries) - 1, 0)


def test_cpu_graphs_equal_eager_and_peft(case, monkeypatch):
    """Decode steps of a batch mixing three adapters and the base model replay CPU graphs (the LoRA layers'
    static path, chapter 30h) and give the tokens of the eager engine and of peft, adapter by adapter. The
    slots change between the runs' steps (LRU, max_loras=2 < 3 adapters) while the graphs stay the same."""
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    _, path, prompts, max_tokens, loras, _ = case
    assignment = _assignment()
    requests = [loras[n] if n else None for n in assignment]
    graphs, got = _run(path, prompts, max_tokens, requests)
    eager, want = _run(path, prompts, max_tokens, requests, enforce_eager=True)
    assert _runner(graphs).cudagraphs and _graph_replays(graphs) > 0, "no decode step replayed a CPU graph"
    assert not _runner(eager).cudagraphs
    assert got == want
    _check(case, got, assignment)
    # fewer slots than adapters: steps with different slot contents replay the same graphs
    swapped, again = _run(path, prompts, max_tokens, requests, max_loras=2, max_cpu_loras=3)
    assert _graph_replays(swapped) > 0
    assert _runner(swapped).lora_manager.adapter_manager.num_evictions > 0
    _check(case, again, assignment)
