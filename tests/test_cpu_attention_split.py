"""The CPU attention kernel's (token, head) split and its AVX512-BF16 dot products (issue 31, item 3).

Every path against the torch reference backend on random paged steps: float32 (the AVX2 D=64 path and the
generic loop) and bfloat16 (AVX512-BF16 dot products where this CPU has them, the generic loop with
`avx512_bf16` hidden by `MINIVLLM_CPU_FLAGS`), head sizes 16 to 256, steps with few tokens (each token's
keys split into parts of ~256 and merged: split-K) and many (a token per work item), windows and soft-caps;
the result does not depend on the thread count; a library built with the flag hidden has no AVX512-BF16
function at all.
A path this CPU cannot run is skipped, saying why.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu_attention import (
    cpu_attention_available,
    cpu_attention_path,
    load_cpu_attention_lib,
    unified_attention_cpu,
)
from kernels.cpu_build import cpu_flags
from minivllm.testing import make_common_attn_metadata
from minivllm.v1.attention.backends.torch_ref import TorchRefAttentionBackend, reshape_and_cache
from minivllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.skipif(
    not cpu_attention_available(), reason="no C compiler: no CPU attention kernel"
)

ROOT = Path(__file__).resolve().parents[1]
FEW = dict(query_lens=[1, 1, 3], seq_lens=[700, 17, 40])  # 5 tokens, 2 threads: split-K (700 keys: 3 parts)
MANY = dict(query_lens=[9, 7, 1, 1, 1], seq_lens=[9, 27, 33, 16, 5])  # 19 tokens: a token per work item
BF16_DP = "paged_attention_bf16_dp"


def _has_bf16_dp() -> bool:
    return hasattr(load_cpu_attention_lib(), BF16_DP) and "avx512_bf16" in cpu_flags()


def _hide_bf16_dp(monkeypatch) -> None:
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", " ".join(sorted(cpu_flags() - {"avx512_bf16"})))


def _step(query_lens, seq_lens, D, dtype, window=None, soft_cap=None, Hkv=3, G=3, bs=16, seed=0):
    "A random paged step: (q, kv cache with this step's K/V written, metadata, the reference output)."
    g = torch.Generator().manual_seed(seed)
    Hq, need = Hkv * G, [-(-s // bs) for s in seq_lens]
    num_blocks = sum(need) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    cm = make_common_attn_metadata(query_lens, seq_lens, tables, bs)
    T = cm.num_actual_tokens
    kv = torch.randn(2, num_blocks, bs, Hkv, D, generator=g).to(dtype)
    query, key, value = (torch.randn(T, H * D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    if window:
        spec = SlidingWindowSpec(bs, Hkv, D, dtype, sliding_window=window)
    else:
        spec = FullAttentionSpec(bs, Hkv, D, dtype)
    md = TorchRefAttentionBackend.get_builder_cls()(spec, ["l"], None, "cpu").build(0, cm)
    impl = TorchRefAttentionBackend.get_impl_cls()(
        Hq, D, D**-0.5, Hkv, sliding_window=window, logits_soft_cap=soft_cap
    )
    cache = kv.clone()
    ref = impl.forward(None, query, key, value, kv, md)
    reshape_and_cache(key.view(T, Hkv, D), value.view(T, Hkv, D), cache[0], cache[1], cm.slot_mapping)
    return query.view(T, Hq, D), cache, cm, ref.view(T, Hq, D)


def _attend(q, cache, cm, D, window=None, soft_cap=None, num_threads=None):
    out = torch.zeros_like(q)
    args = (cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, D**-0.5, cm.max_query_len)
    unified_attention_cpu(q, cache[0], cache[1], out, *args, window, soft_cap, num_threads)
    return out


@pytest.mark.parametrize("D", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("shape", ["few", "many"])
@pytest.mark.parametrize("path", ["float32", "bfloat16-dp", "bfloat16-generic"])
def test_kernel_equals_torch_reference(path, shape, D, monkeypatch):
    dtype = torch.float32 if path == "float32" else torch.bfloat16
    if path == "bfloat16-dp" and not _has_bf16_dp():
        pytest.skip(
            "no AVX512-BF16 here (cpu_flags() lacks avx512_bf16, or the library was built without it)"
        )
    if path == "bfloat16-generic":
        _hide_bf16_dp(monkeypatch)
    expected = {
        "float32": "paged_attention_f32",
        "bfloat16-dp": BF16_DP,
        "bfloat16-generic": "paged_attention_bf16",
    }
    if path == "float32" and D == 64 and hasattr(load_cpu_attention_lib(), "paged_attention_f32_vec"):
        expected["float32"] = "paged_attention_f32_vec"
    assert cpu_attention_path(dtype, D) == expected[path]
    q, cache, cm, ref = _step(**(FEW if shape == "few" else MANY), D=D, dtype=dtype, seed=D)
    out = _attend(q, cache, cm, D, num_threads=2)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < (5e-6 if dtype == torch.float32 else 2e-2), f"{path} D={D}: max error {err}"
    assert out.abs().sum() > 0


@pytest.mark.parametrize("path", ["bfloat16-dp", "bfloat16-generic"])
def test_window_and_soft_cap(path, monkeypatch):
    if path == "bfloat16-dp" and not _has_bf16_dp():
        pytest.skip("no AVX512-BF16 here")
    if path == "bfloat16-generic":
        _hide_bf16_dp(monkeypatch)
    q, cache, cm, ref = _step(**MANY, D=80, dtype=torch.bfloat16, window=7, soft_cap=3.0, seed=5)
    out = _attend(q, cache, cm, 80, window=7, soft_cap=3.0)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("path", ["float32", "bfloat16-dp", "bfloat16-generic"])
def test_split_does_not_change_the_result(path, monkeypatch):
    "One decoding sequence's key parts spread over 1, 2 or 3 threads: bit-for-bit the same output."
    if path == "bfloat16-dp" and not _has_bf16_dp():
        pytest.skip("no AVX512-BF16 here")
    if path == "bfloat16-generic":
        _hide_bf16_dp(monkeypatch)
    dtype = torch.float32 if path == "float32" else torch.bfloat16
    q, cache, cm, _ = _step([1], [1000], D=128, dtype=dtype, seed=3)  # 4 parts of 250 keys
    outs = [_attend(q, cache, cm, 128, num_threads=n) for n in (1, 2, 3)]
    assert outs[0].abs().sum() > 0
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_dp_and_generic_bf16_agree(monkeypatch):
    "The two bfloat16 paths differ only in float32 summation order: far below a bfloat16 step."
    if not _has_bf16_dp():
        pytest.skip("no AVX512-BF16 here")
    q, cache, cm, _ = _step(**FEW, D=128, dtype=torch.bfloat16, seed=9)
    dp = _attend(q, cache, cm, 128)
    _hide_bf16_dp(monkeypatch)
    generic = _attend(q, cache, cm, 128)
    diff = (dp.float() - generic.float()).abs().max().item()
    assert diff <= 2**-7 * dp.float().abs().max().item()  # at most about one bfloat16 rounding step


def test_hidden_flag_builds_without_the_bf16_function(tmp_path):
    "With avx512_bf16 hidden the library is compiled without AVX512-BF16: the function does not exist."
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no avx512_bf16 to hide")
    env = dict(
        os.environ,
        MINIVLLM_CACHE_DIR=str(tmp_path),
        MINIVLLM_CPU_FLAGS=" ".join(cpu_flags() - {"avx512_bf16"}),
    )
    code = (
        "import torch\n"
        "from kernels.cpu_attention import load_cpu_attention_lib as L, cpu_attention_path as P\n"
        f"print(hasattr(L(), {BF16_DP!r}), P(torch.bfloat16, 128))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "paged_attention_bf16"]
