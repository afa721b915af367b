"""MINIVLLM_CPU_FLAGS reaches the compiled C kernels (kernels chapter 01a), not only the Python policies.

- with only `sse2` in view, the real kernel libraries (CPU attention, CPU ops) contain no VEX / EVEX
  instruction (no AVX, AVX2, FMA, AVX-512: no `v...` mnemonic, no ymm / zmm register), while the same
  sources built for this CPU do where it has AVX (so the check can fail); the C GEMM, AVX2 code, does
  not build at all;
- names are read in any case; a list with no CPU flag name at all is a ValueError naming the variable,
  raised when the engine's config is built.
"""
import re
import shutil
import subprocess

import pytest

from minivllm_kernels import cpu_build
from minivllm_kernels.cpu_attention import CPU_ATTENTION_SRC
from minivllm_kernels.cpu_build import CFLAGS, build_cpu_library, cpu_flags, find_c_compiler, kernel_cache_dir
from minivllm_kernels.cpu_gemm import CPU_GEMM_SRC
from minivllm_kernels.cpu_ops import CPU_OPS_CFLAGS, CPU_OPS_SRC



def _vector_mnemonics(lib_path) -> set[str]:
    "The VEX / EVEX-encoded (`v...`) mnemonics and ymm / zmm registers in a shared library's code."
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib_path)], capture_output=True,
                         text=True, check=True).stdout
    found = set(re.findall(r"^\s*[0-9a-f]+:\s+(v[a-z0-9]+)\s", out, re.M))
    return found | set(re.findall(r"%([yz]mm)\d+", out))


@pytest.mark.skipif(find_c_compiler() is None or shutil.which("objdump") is None,
                    reason="needs a C compiler and objdump")
@pytest.mark.skipif(not cpu_flags() & {"avx", "avx2"}, reason="this CPU has no AVX to hide")
@pytest.mark.parametrize(
    "name,source,cflags",
    [("cpu_attention", CPU_ATTENTION_SRC, CFLAGS), ("cpu_ops", CPU_OPS_SRC, CPU_OPS_CFLAGS)],
)
def test_sse2_only_builds_have_no_avx_instructions(monkeypatch, tmp_path, name, source, cflags):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINIVLLM_CPU_FLAGS", raising=False)
    assert build_cpu_library(name, source, cflags) is not None
    (native,) = kernel_cache_dir().glob(f"{name}-*.so")
    assert _vector_mnemonics(native)  # this CPU's own build does use them
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "SSE2")
    assert build_cpu_library(name, source, cflags) is not None
    (hidden,) = set(kernel_cache_dir().glob(f"{name}-*.so")) - {native}
    assert _vector_mnemonics(hidden) == set()


def test_the_c_gemm_under_sse2_is_no_library_not_an_avx_one(monkeypatch, tmp_path):
    "The C GEMM is AVX2 code: with AVX2 hidden it does not build (callers never ask: they check the flags)."
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "sse2")
    assert build_cpu_library("cpu_gemm", CPU_GEMM_SRC, CFLAGS) is None
    assert list(kernel_cache_dir().glob("cpu_gemm-*.so")) == []


def test_flag_names_are_case_insensitive_and_a_list_of_no_flags_is_an_error(monkeypatch, tmp_path):
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.testing import make_tiny_checkpoint
    real = cpu_flags()
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "AVX2,Fma")
    assert cpu_flags() == real & {"avx2", "fma"}
    monkeypatch.setattr(cpu_build, "_WARNED_ABSENT", set())
    for bad in ("none", "avx-2 fmaa", "0"):
        monkeypatch.setenv("MINIVLLM_CPU_FLAGS", bad)
        with pytest.raises(ValueError, match=r"MINIVLLM_CPU_FLAGS=.*names no CPU flag"):
            cpu_flags()
    ckpt = make_tiny_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_FLAGS"):
        EngineArgs(model=str(ckpt), dtype="auto", max_model_len=64).create_engine_config()


_ARGMAX_CHECK = """
import torch
from minivllm_kernels.cpu_ops import argmax_rows
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows, n in ((1, 1), (3, 9), (2, 15), (4, 16), (5, 33), (3, 1000), (8, 49152)):
        x = torch.randint(-3, 3, (rows, n), generator=g).to(dtype)  # many ties: the first index wins
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), (dtype, rows, n)
        y = torch.randn(rows, n, generator=g).to(dtype)
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1)), (dtype, rows, n)
z = torch.randn(4, 100, generator=g)
z[0, 50] = z[0, 70] = float("nan")
z[1, 99] = float("nan")
z[2] = float("-inf")
assert argmax_rows(z).tolist() == z.argmax(dim=-1).tolist()
print("ok")
"""


@pytest.mark.skipif(find_c_compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize("view", ["", "avx2,fma,f16c", "sse2"])
def test_greedy_pick_equals_torch_argmax_on_each_build(tmp_path, view):
    """`argmax_rows` (kernels chapter 03) has an AVX-512 scan, an AVX2 one and a scalar one; each CPU view
    builds its own library (in a fresh process, the library is cached per process) and must give torch's
    index: the first on ties, the first NaN. A view this CPU lacks only narrows to what it has."""
    import os
    import sys
    env = {**os.environ, "MINIVLLM_CACHE_DIR": str(tmp_path), "MINIVLLM_CPU_FLAGS": view}
    res = subprocess.run([sys.executable, "-c", _ARGMAX_CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
