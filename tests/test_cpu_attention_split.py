"""The CPU attention kernel's paths against the torch reference (issue 31, item 3: the bfloat16 split).

Every path this CPU can run, chosen through `cpu_attention_path` with `MINIVLLM_CPU_FLAGS` hiding the flags
of the paths before it: the AVX-512 paths (a work item per KV head: float32, bfloat16 with AVX512-BF16 dot
products, bfloat16 widened to float32), the AVX512-BF16 dot products per token, the AVX2 float32 path and
the generic loops. Each against the torch reference backend on random paged steps: few tokens (split-K),
many (prompts and decodes mixed), 32 decodes, windows and soft-caps, GQA groups of 1 to 8, head sizes 16 to
256 (80 and 96 end in masked pieces; 24 has no AVX-512 path and falls back). The AVX-512 paths give the same
bits on 1, 2 or 3 threads for every step (their split depends on the token count only); `skip_reqs` rows stay
untouched; many long decodes are split too; a library built with `avx512_bf16` hidden has none of its
functions.
A path this CPU cannot run is skipped, naming the missing flag.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm_kernels.cpu_attention import (
    cpu_attention_available,
    cpu_attention_path,
    load_cpu_attention_lib,
    unified_attention_cpu,
)
from minivllm_kernels.cpu_build import cpu_flags
from minivllm.testing import make_common_attn_metadata
from minivllm.v1.attention.backends.torch_ref import TorchRefAttentionBackend, reshape_and_cache
from minivllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.skipif(
    not cpu_attention_available(), reason="no C compiler: no CPU attention kernel"
)

ROOT = Path(__file__).resolve().parents[1]
FEW = dict(query_lens=[1, 1, 3], seq_lens=[700, 17, 40])  # 5 tokens: split-K (700 keys: 3 parts)
MANY = dict(query_lens=[9, 7, 1, 1, 1], seq_lens=[9, 27, 33, 16, 5])  # 19 tokens: prompts, a chunk, decodes
DECODE32 = dict(query_lens=[1] * 32, seq_lens=[104 + i % 8 for i in range(32)])  # SmolLM2's decode batch
LONG17 = dict(query_lens=[1] * 15 + [3, 2], seq_lens=[300 + 37 * i for i in range(17)])  # 17 tokens, long
SHAPES = dict(few=FEW, many=MANY, decode32=DECODE32)
AVX512 = {"avx512f", "avx512bw", "avx512vl"}
BF16_DP = "paged_attention_bf16_dp"
NEW_BF16_DP = "paged_attention_avx512_bf16_dp"
PATHS = {  # name: (dtype, flags hidden, flags needed, the function it selects; None: the float32 fallback)
    "float32-avx512": (torch.float32, set(), AVX512, "paged_attention_avx512_f32"),
    "float32": (torch.float32, {"avx512f"}, set(), None),
    "bfloat16-avx512-dp": (torch.bfloat16, set(), AVX512 | {"avx512_bf16"}, NEW_BF16_DP),
    "bfloat16-avx512": (torch.bfloat16, {"avx512_bf16"}, AVX512, "paged_attention_avx512_bf16"),
    "bfloat16-dp": (torch.bfloat16, {"avx512f"}, {"avx512_bf16"}, BF16_DP),
    "bfloat16-generic": (torch.bfloat16, {"avx512f", "avx512_bf16"}, set(), "paged_attention_bf16"),
}
NEW_PATHS = ["float32-avx512", "bfloat16-avx512-dp", "bfloat16-avx512"]


def _select(path: str, D: int, monkeypatch) -> torch.dtype:
    "Hide the flags of the paths before `path` (or skip, naming what this CPU lacks); check the choice."
    dtype, hide, need, expected = PATHS[path]
    missing = sorted(need - cpu_flags())
    if missing:
        pytest.skip(f"{path} needs CPU flags {', '.join(missing)}, which cpu_flags() lacks here")
    lib = load_cpu_attention_lib()
    if expected is None:
        vec = D == 64 and hasattr(lib, "paged_attention_f32_vec")
        expected = "paged_attention_f32_vec" if vec else "paged_attention_f32"
    if not hasattr(lib, expected):
        pytest.skip(f"the library was built without {expected} (the compiler does not target its flags)")
    if hide:
        monkeypatch.setenv("MINIVLLM_CPU_FLAGS", " ".join(sorted(cpu_flags() - hide)))
    assert cpu_attention_path(dtype, D) == expected
    return dtype


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


def _attend(q, cache, cm, D, window=None, soft_cap=None, num_threads=None, skip=None):
    out = torch.zeros_like(q)
    args = (cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, D**-0.5, cm.max_query_len)
    unified_attention_cpu(q, cache[0], cache[1], out, *args, window, soft_cap, num_threads, skip)
    return out


def _max_error(out, ref) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _tol(dtype) -> float:
    return 5e-6 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("D", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("path", list(PATHS))
def test_kernel_equals_torch_reference(path, shape, D, monkeypatch):
    dtype = _select(path, D, monkeypatch)
    q, cache, cm, ref = _step(**SHAPES[shape], D=D, dtype=dtype, seed=D)
    out = _attend(q, cache, cm, D, num_threads=2)
    assert _max_error(out, ref) < _tol(dtype), f"{path} {shape} D={D}: max error {_max_error(out, ref)}"
    assert out.abs().sum() > 0


@pytest.mark.parametrize("G", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("path", NEW_PATHS)
def test_gqa_groups_windows_and_soft_cap(path, G, monkeypatch):
    "Groups of 1-8 query heads per KV head (P.V in groups of at most four), with a window and a soft-cap."
    dtype = _select(path, 64, monkeypatch)
    for shape, window, cap in (("many", 7, 3.0), ("decode32", 20, None), ("few", 300, 5.0)):
        q, cache, cm, ref = _step(**SHAPES[shape], D=64, dtype=dtype, G=G, Hkv=2, window=window, soft_cap=cap)
        out = _attend(q, cache, cm, 64, window=window, soft_cap=cap)
        assert _max_error(out, ref) < _tol(dtype), f"{path} G={G} {shape}: {_max_error(out, ref)}"


@pytest.mark.parametrize("path", ["bfloat16-avx512-dp", "bfloat16-avx512", "bfloat16-dp", "bfloat16-generic"])
def test_window_and_soft_cap(path, monkeypatch):
    dtype = _select(path, 80, monkeypatch)
    q, cache, cm, ref = _step(**MANY, D=80, dtype=dtype, window=7, soft_cap=3.0, seed=5)
    out = _attend(q, cache, cm, 80, window=7, soft_cap=3.0)
    assert _max_error(out, ref) < 2e-2


def test_a_long_prompt_on_the_avx512_path(monkeypatch):
    "A 300-token prompt after 200 cached tokens and two decodes: every prompt token is an item of its own."
    dtype = _select(
        "bfloat16-avx512-dp" if "avx512_bf16" in cpu_flags() else "bfloat16-avx512", 128, monkeypatch
    )
    q, cache, cm, ref = _step([300, 1, 1], [500, 40, 1], D=128, dtype=dtype, Hkv=2, G=4, seed=11)
    assert _max_error(_attend(q, cache, cm, 128), ref) < 2e-2


@pytest.mark.parametrize("path", list(PATHS))
def test_split_does_not_change_the_result(path, monkeypatch):
    "One decoding sequence's key parts spread over 1, 2 or 3 threads: bit-for-bit the same output."
    dtype = _select(path, 128, monkeypatch)
    q, cache, cm, _ = _step([1], [1000], D=128, dtype=dtype, seed=3)  # 4 parts of 250 keys
    outs = [_attend(q, cache, cm, 128, num_threads=n) for n in (1, 2, 3)]
    assert outs[0].abs().sum() > 0
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("path", NEW_PATHS)
def test_many_long_tokens_are_split_too(path, D, monkeypatch):
    "15 decodes and 2 short chunks of 300-900 keys: over 16 tokens, but the parts fit 16 MiB, so split-K too."
    dtype = _select(path, D, monkeypatch)
    q, cache, cm, ref = _step(**LONG17, D=D, dtype=dtype, seed=D + 1)
    out = _attend(q, cache, cm, D, num_threads=2)
    assert _max_error(out, ref) < _tol(dtype)


@pytest.mark.parametrize("shape", [*SHAPES, "long17"])
@pytest.mark.parametrize("path", NEW_PATHS)
def test_avx512_paths_do_not_depend_on_the_thread_count(path, shape, monkeypatch):
    "Their split depends on the step alone: 5 tokens are split on one thread as on three."
    dtype = _select(path, 64, monkeypatch)
    q, cache, cm, _ = _step(**{**SHAPES, "long17": LONG17}[shape], D=64, dtype=dtype, seed=4)
    outs = [_attend(q, cache, cm, 64, num_threads=n) for n in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("path", NEW_PATHS)
def test_skip_reqs_rows_stay_untouched(path, monkeypatch):
    dtype = _select(path, 64, monkeypatch)
    q, cache, cm, ref = _step(**MANY, D=64, dtype=dtype, seed=6)
    skip = torch.tensor([1, 0, 0, 1, 0], dtype=torch.uint8)
    out = _attend(q, cache, cm, 64, skip=skip)
    qsl = cm.query_start_loc.tolist()
    for r, skipped in enumerate(skip.tolist()):
        rows = slice(qsl[r], qsl[r + 1])
        if skipped:
            assert out[rows].abs().sum() == 0
        else:
            assert _max_error(out[rows], ref[rows]) < _tol(dtype)


def test_other_head_sizes_fall_back():
    "Head size 24 is not a multiple of 16: the paths before the AVX-512 ones, still right."
    assert not cpu_attention_path(torch.float32, 24).startswith("paged_attention_avx512")
    assert not cpu_attention_path(torch.bfloat16, 24).startswith("paged_attention_avx512")
    for dtype in (torch.float32, torch.bfloat16):
        q, cache, cm, ref = _step(**MANY, D=24, dtype=dtype, seed=7)
        assert _max_error(_attend(q, cache, cm, 24), ref) < _tol(dtype)


@pytest.mark.parametrize("path", ["bfloat16-avx512-dp", "bfloat16-avx512", "bfloat16-dp"])
def test_bf16_paths_agree_with_the_generic_loop(path, monkeypatch):
    "The bfloat16 paths differ only in float32 summation order: at most about one bfloat16 step."
    _select(path, 128, monkeypatch)
    q, cache, cm, _ = _step(**FEW, D=128, dtype=torch.bfloat16, seed=9)
    fast = _attend(q, cache, cm, 128)
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", " ".join(sorted(cpu_flags() - {"avx512f", "avx512_bf16"})))
    assert cpu_attention_path(torch.bfloat16, 128) == "paged_attention_bf16"
    generic = _attend(q, cache, cm, 128)
    diff = (fast.float() - generic.float()).abs().max().item()
    assert diff <= 2**-7 * fast.float().abs().max().item()


def test_hidden_flag_builds_without_the_bf16_functions(tmp_path):
    "With avx512_bf16 hidden the library is built without AVX512-BF16: neither dot-product function exists."
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no avx512_bf16 to hide")
    env = dict(
        os.environ,
        MINIVLLM_CACHE_DIR=str(tmp_path),
        MINIVLLM_CPU_FLAGS=" ".join(cpu_flags() - {"avx512_bf16"}),
    )
    code = (
        "import torch\n"
        "from minivllm_kernels.cpu_attention import load_cpu_attention_lib as L, cpu_attention_path as P\n"
        f"print(hasattr(L(), {BF16_DP!r}), hasattr(L(), {NEW_BF16_DP!r}), P(torch.bfloat16, 128))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    expected = "paged_attention_avx512_bf16" if AVX512 <= cpu_flags() else "paged_attention_bf16"
    assert res.stdout.split() == ["False", "False", expected]
