"""The Triton LoRA kernels (minivllm_kernels/lora_ops.py, issue 32) against the PyTorch reference of chapter 30h.

On the CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set here before anything imports them), so
shapes stay tiny: random mixed batches (adapter tokens of several slots, base-model tokens, ranks below the
slot rank, packed q/k/v slices) through `PunicaWrapperCPU(kernel="triton")` must give the reference's
`add_lora_linear` to float rounding, for the fused buffers of the LoRA layers too. The GPU tests (skipped
without CUDA) repeat the kernel check on CUDA in float32 / float16 / bfloat16 and serve a tiny model with
three adapters and the base model in one batch: the Triton kernels (the CUDA default) give the greedy tokens
of the torch reference kernel on the same GPU.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from minivllm_kernels.lora_ops import bgmv_expand, bgmv_shrink  # noqa: E402
from minivllm.lora.punica_wrapper.punica_cpu import LoRAMapping, PunicaWrapperCPU  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(seed, device, dtype):
    "(wrapper inputs, expected y) of one random mixed step over packed slices."
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    L, R, K = rng.choice([1, 2, 4]), rng.choice([4, 8, 16]), rng.choice([16, 40, 96])
    slices = rng.choice([(24,), (32, 8, 8), (48, 48)])
    T = rng.randint(1, 12)
    ids = [rng.choice([0] + list(range(1, L + 1))) for _ in range(T)]
    A = tuple(torch.zeros(L, 1, R, K) for _ in slices)
    B = tuple(torch.zeros(L, 1, n, R) for n in slices)
    for a, b in zip(A, B):
        r = rng.randint(1, R)  # an adapter's rank below the slot's: the rest stays zero
        a[:, 0, :r] = torch.randn(L, r, K, generator=g)
        b[:, 0, :, :r] = torch.randn(L, b.shape[2], r, generator=g) * 0.1
    x = torch.randn(T, K, generator=g)
    y = torch.randn(T, sum(slices), generator=g)
    mapping = LoRAMapping(ids, ids)
    to = dict(device=device, dtype=dtype)
    return (
        mapping,
        L,
        x.to(**to),
        y.to(**to),
        tuple(a.to(**to) for a in A),
        tuple(b.to(**to) for b in B),
        slices,
    )


def _run(kernel, mapping, L, x, y, A, B, slices, device):
    pw = PunicaWrapperCPU(64, 16, device, kernel=kernel)
    pw.update_metadata(mapping, list(range(1, L + 1)), L)  # slot s holds id s + 1
    out = y.clone()
    pw.add_lora_linear(out, x, A, B, 0.5, slices)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_triton_add_lora_linear_equals_reference(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _case(seed, device, torch.float32)
    want = _run("torch", *case, device)
    got = _run("triton", *case, device)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
    mapping, _, _, y, *_ = case
    base_rows = torch.tensor(mapping.index_mapping == 0)
    assert torch.equal(got[base_rows.to(device)], y[base_rows.to(device)])  # base-model rows untouched


def test_triton_reads_the_layers_fused_buffers():
    "A LoRA layer's fused A slice and transposed B view (chapter 30i) are read in place."
    from minivllm.lora.config import LoRAConfig
    from minivllm.lora.layers import from_layer
    from minivllm.model_executor.layers.linear import QKVParallelLinear

    torch.manual_seed(0)
    qkv = QKVParallelLinear(12, 4, total_num_heads=2, total_num_kv_heads=1, bias=False)
    qkv.weight.data.normal_()
    layer = from_layer(qkv, 2, LoRAConfig(max_lora_rank=8, max_loras=2), ["q_proj", "k_proj", "v_proj"])
    layer.set_lora(
        1, [torch.randn(3, 12), None, torch.randn(5, 12)], [torch.randn(8, 3), None, torch.randn(4, 5)]
    )
    layer.set_lora(0, [None, torch.randn(8, 12), None], [None, torch.randn(4, 8), None])
    x = torch.randn(5, 12)
    outs = {}
    for kernel in ("torch", "cpu", "triton"):
        pw = PunicaWrapperCPU(8, 4, "cpu", kernel=kernel)
        pw.update_metadata(LoRAMapping([7, 0, 3, 7, 3], [7, 0, 3]), [3, 7], 2)
        layer.set_mapping(pw)
        outs[kernel] = layer(x)[0]
    assert torch.allclose(outs["triton"], outs["torch"], atol=1e-4)
    assert torch.allclose(outs["cpu"], outs["torch"], atol=1e-4)


def test_launchers_refuse_mismatches():
    x, a, h = torch.randn(3, 8), torch.randn(2, 4, 8), torch.empty(3, 4)
    with pytest.raises(ValueError, match="do not fit"):
        bgmv_shrink(x, a, torch.empty(3, 5), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="lora_indices_tensor"):
        bgmv_shrink(x, a, h, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="beyond"):
        bgmv_expand(h, torch.randn(2, 6, 4), torch.zeros(3, 6), torch.full((3,), 2))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_kernels_match_reference(dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for seed in range(10):
        case = _case(seed, "cuda", dtype)
        want = _run("torch", *case, "cuda").float()
        got = _run("triton", *case, "cuda").float()
        err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        assert err < tol, (seed, dtype, err)


@cuda
def test_gpu_mixed_adapters_triton_equals_torch_kernel(tmp_path, monkeypatch):
    "A tiny Llama on CUDA, three adapters and the base model in one batch: Triton == torch reference tokens."
    import transformers

    from minivllm.entrypoints.llm import LLM
    from minivllm.lora.models import make_random_lora_adapter
    from minivllm.lora.request import LoRARequest
    from minivllm.sampling_params import SamplingParams
    from minivllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "base")
    cfg = transformers.AutoConfig.from_pretrained(path)
    loras = [
        LoRARequest(
            f"a{i}", i + 1, make_random_lora_adapter(str(tmp_path / f"a{i}"), cfg, rank=8, seed=i, std=0.2)
        )
        for i in range(3)
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    requests = [None if i % 4 == 0 else loras[i % 4 - 1] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for kernel in ("triton", "torch"):
        monkeypatch.setenv("MINIVLLM_LORA_KERNEL", kernel)
        llm = LLM(
            path,
            dtype="float32",
            device="cuda",
            max_model_len=128,
            enable_lora=True,
            max_lora_rank=8,
            max_loras=3,
            kv_cache_memory_bytes=1 << 26,
        )
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        assert runner.lora_manager.adapter_manager.punica_wrapper.kernel == kernel
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=requests
        )
        tokens[kernel] = [list(o.outputs[0].token_ids) for o in outs]
        del llm, runner
    assert tokens["triton"] == tokens["torch"]
    assert len({tuple(t) for t in tokens["triton"]}) > 1
