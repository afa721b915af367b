"""The Triton kernels compile for a Hopper GPU (sm_90) on a machine without one.

The interpreter (used by the other kernel tests on the CPU) runs kernels as numpy code and forgives what the
compiler does not (a loop-carried value changing type, a shape the tensor cores cannot take). Triton's wheel
carries the whole NVIDIA backend (MLIR passes, LLVM, ptxas), so `triton.compile` can take each kernel to a
cubin here: a kernel that would fail to compile on the GPU fails here. Nothing is launched. The compiles run
in a child process without TRITON_INTERPRET (other test modules set it for this process, and `@triton.jit`
reads it when the kernel modules are imported).
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CASES = [  # dtype, G, D, block size, BLOCK_M, window, soft-cap, num_seqs constant
    ("bf16", 2, 128, 16, 64, 0, False, None),     # Qwen3-0.6B prefill/mixed
    ("bf16", 2, 128, 16, 16, 0, False, 1),        # decode-only launch, one sequence (an int 1 becomes a constant)
    ("fp16", 3, 80, 12, 64, 128, True, None),     # GQA 3:1, odd head and block sizes, window + soft-cap
    ("fp32", 1, 64, 32, 16, 0, False, None),      # float32: exact (ieee) dots
]


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from minivllm_kernels.reshape_and_cache import _reshape_and_cache_kernel
    from minivllm_kernels.unified_attention import _unified_attention_kernel

    def compile_for_hopper(fn, types, consts):
        names = fn.arg_names
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]

    fn = _unified_attention_kernel
    for dtype, G, D, bs, block_m, window, cap, num_seqs in CASES:
        types = {n: "i32" for n in fn.arg_names}
        types.update({n: "*" + dtype for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")})
        types.update(block_table_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", scale="fp32", soft_cap="fp32")
        consts = dict(NUM_QUERIES_PER_KV=G, HEAD_SIZE=D, HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(D)),
                      BLOCK_SIZE=bs, TILE=max(16, min(64, triton.next_power_of_2(bs))), BLOCK_Q=block_m // G,
                      BLOCK_M=block_m, SLIDING_WINDOW=window, USE_SOFTCAP=cap,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        if num_seqs is not None: consts["num_seqs"] = num_seqs
        compile_for_hopper(fn, types, consts)
        print("unified_attention", dtype, G, D, bs, block_m, window, cap, num_seqs, "ok")
    fn = _reshape_and_cache_kernel
    types = {n: "i32" for n in fn.arg_names}
    types.update({n: "*bf16" for n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}, slot_mapping_ptr="*i64")
    compile_for_hopper(fn, types, dict(BLOCK_SIZE=16, ROW=1024, ROW_PADDED=1024))
    print("reshape_and_cache ok")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok") == len(CASES) + 1, r.stdout


if __name__ == "__main__":
    compile_all()
