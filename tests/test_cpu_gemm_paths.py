"""Every CPU GEMM path, on whatever CPU runs the tests: graphs on == graphs off == transformers.

Which kernel multiplies a CPU linear depends on the CPU (kernels chapter 04, chapter 30b): the C GEMM
(`cpu_gemm`, AVX2 + FMA), its bfloat16 pairs kernel (`cpu_gemm_bf16_dp`, AVX512-BF16) and AMX kernel
(`cpu_gemm_bf16_amx`, AMX-TILE + AMX-BF16; both chosen only by measurement, forced below), oneDNN's packed weights (`onednn`, the default on AVX-512 CPUs; opaque mkldnn
tensors, which once killed CPU-graph capture), or plain `F.linear`. `MINIVLLM_CPU_GEMM=1` forces the C GEMM,
`MINIVLLM_CPU_GEMM=0` leaves oneDNN, adding `MINIVLLM_CPU_ONEDNN_GEMM=0` leaves `F.linear`, so each path runs
here whatever the CPU would pick by default; a path this CPU cannot execute is skipped with the reason. The
`auto` policy itself is checked through `MINIVLLM_CPU_FLAGS`, which hides flags (never adds them) to make
this CPU look like another class.

float32 runs are compared with transformers token for token. bfloat16 rounds differently in each GEMM (and
in transformers), so there a path's graphs are compared with the same path run eagerly.
"""
import json
import random

import pytest
import torch

from minivllm_kernels.cpu_attention import cpu_attention_available
from minivllm_kernels.cpu_build import cpu_flags
from minivllm_kernels.cpu_gemm import load_cpu_gemm_lib
from minivllm.compilation_config import CUDAGraphMode
from minivllm.config import cpu_has_native_bf16, resolve_auto_dtype_for_cpu
from minivllm.entrypoints.llm import LLM
from minivllm.model_executor.layers.linear import _onednn_bf16_supported
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from test_cpu_graphs import greedy, hf_greedy, replays, runner_of  # the same helpers (tests/ is on sys.path)

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's GEMM paths; CUDA runs cuBLAS"),
    pytest.mark.skipif(not cpu_attention_available(), reason="needs the C kernels (a C compiler)"),
]

PATHS = {  # path -> (env, the cpu_linear_kind every linear must report)
    "cpu_gemm": ({"MINIVLLM_CPU_GEMM": "1"}, "cpu_gemm"),
    "onednn": ({"MINIVLLM_CPU_GEMM": "0"}, "onednn"),
    "F.linear": ({"MINIVLLM_CPU_GEMM": "0", "MINIVLLM_CPU_ONEDNN_GEMM": "0"}, None),
}
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


def cannot_run(path: str, dtype: str) -> str | None:
    "Why this CPU cannot execute `path` in `dtype`, or None."
    if path == "cpu_gemm" and not {"avx2", "fma"} <= cpu_flags():
        return "the C GEMM needs AVX2 and FMA, which this CPU lacks"
    if path == "cpu_gemm" and load_cpu_gemm_lib() is None:
        return "the C GEMM could not be built here"
    if path == "onednn" and not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if path == "onednn" and dtype == "bfloat16" and not _onednn_bf16_supported():
        return "oneDNN bfloat16 needs AVX-512 or AVX-NE-CONVERT, which this CPU lacks"
    return None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def linear_kinds(llm) -> set:
    "cpu_linear_kind of every linear of the model (the LM head included)."
    return {
        getattr(m, "cpu_linear_kind", None)
        for m in runner_of(llm).model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "cpu_linear")
    }


def set_path(monkeypatch, path):
    for var in ("MINIVLLM_CPU_GEMM", "MINIVLLM_CPU_ONEDNN_GEMM", "MINIVLLM_CPU_FLAGS", "MINIVLLM_CUDAGRAPH_MODE",
                "MINIVLLM_CPU_GEMM_TUNING"):
        monkeypatch.delenv(var, raising=False)
    env, kind = PATHS[path]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return kind


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_gemm_path_graphs_equal_eager_and_transformers(path, dtype, tiny, monkeypatch):
    reason = cannot_run(path, dtype)
    if reason:
        pytest.skip(reason)
    kind = set_path(monkeypatch, path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 21, 8)]
    max_tokens = [10, 5, 8]
    llm = LLM(tiny, dtype=dtype, **ENGINE)
    assert linear_kinds(llm) == {kind}
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert runner_of(llm).cudagraphs, "CPU graphs were captured"
    before = replays(llm)
    graphs = greedy(llm, prompts, max_tokens)
    assert replays(llm) - before >= 7  # every decode step replays (3 requests padded to 4, then 2, 1)
    eager_llm = LLM(tiny, dtype=dtype, enforce_eager=True, **ENGINE)
    assert linear_kinds(eager_llm) == {kind} and not runner_of(eager_llm).cudagraphs
    assert graphs == greedy(eager_llm, prompts, max_tokens)
    if dtype == "float32":
        assert graphs == hf_greedy(tiny, prompts, max_tokens)


# What `auto` picks on each CPU class, reproduced here by hiding flags: an AVX2 laptop (C GEMM in both
# dtypes, dtype=auto falls back to float32), an AVX-512 server without native bfloat16 (oneDNN float32,
# C GEMM bfloat16), this CPU as it is.
VIEWS = {
    "avx2": ("avx2,fma,f16c", {"float32": "cpu_gemm", "bfloat16": "cpu_gemm"}),
    "avx512": ("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq", {"float32": "onednn", "bfloat16": "cpu_gemm"}),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_auto_policy_per_cpu_class(view, tiny, monkeypatch):
    flags, expected = VIEWS[view]
    needed = set(flags.split(",")) - {"f16c"}
    if not needed <= cpu_flags() or load_cpu_gemm_lib() is None:
        pytest.skip(f"this CPU lacks {sorted(needed - cpu_flags())} (a {view} CPU cannot be shown on it)")
    set_path(monkeypatch, "onednn")
    monkeypatch.delenv("MINIVLLM_CPU_GEMM")
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", flags)
    monkeypatch.setenv("MINIVLLM_CPU_GEMM_TUNING", "0")  # the flag policy alone (measured: the test below)
    assert not cpu_has_native_bf16()
    prompts, max_tokens = [[5, 9, 13, 2], [40, 41]], [6, 6]
    for dtype, kind in expected.items():
        llm = LLM(tiny, dtype=dtype, **ENGINE)
        assert linear_kinds(llm) == {kind}, dtype
        before = replays(llm)
        out = greedy(llm, prompts, max_tokens)
        assert replays(llm) > before
        assert out == greedy(LLM(tiny, dtype=dtype, enforce_eager=True, **ENGINE), prompts, max_tokens)
    assert resolve_auto_dtype_for_cpu(torch.bfloat16) == torch.float32  # dtype=auto: no native bfloat16


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bfloat16 (AVX512-BF16 / AMX)")
def test_auto_dtype_keeps_bfloat16_on_native_cpus(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_FLAGS", raising=False)
    assert resolve_auto_dtype_for_cpu(torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "avx2,fma")  # the same CPU seen as an AVX2 one
    assert resolve_auto_dtype_for_cpu(torch.bfloat16) == torch.float32


@pytest.fixture(scope="module")
def smollm2():
    from minivllm.transformers_utils.embedded import get_default_model_path
    return get_default_model_path()


# F.linear on SmolLM2 (MKL repacks every weight, the LM head too, at each call) takes ~30 s: run by .ci/run's
# `make test-slow`, after the default suite
@pytest.mark.parametrize("path", [p if p != "F.linear" else pytest.param(p, marks=pytest.mark.slow) for p in PATHS])
def test_embedded_model_each_gemm_path_with_graphs_equals_transformers(path, smollm2, monkeypatch):
    reason = cannot_run(path, "float32")
    if reason:
        pytest.skip(reason)
    kind = set_path(monkeypatch, path)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                return_dict=True)["input_ids"]
        for q in ("What is the capital of France?", "Name three colours.")
    ]
    llm = LLM(smollm2, dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=256)
    assert linear_kinds(llm) == {kind}
    before = replays(llm)
    ours = greedy(llm, prompts, [12, 12])
    assert replays(llm) - before >= 11
    del llm
    assert ours == hf_greedy(smollm2, prompts, [12, 12]), [tok.decode(o) for o in ours]


# `auto` measures each shape (chapter 30d) and may give a layer a different kernel per row bucket: a decode
# step of 1, of 2-4, a prefill of 5-16, of 17-64 and one of 65+ rows then run on different kernels. Forced here so every
# bucket has its own kernel whatever this CPU measures: graphs (captured per row count) == eager ==
# transformers, and only the kernels chosen are packed.
def test_kernel_per_row_bucket_graphs_equal_eager_and_transformers(tiny, monkeypatch):
    from minivllm.model_executor.layers import linear
    for path in ("cpu_gemm", "onednn"):
        if cannot_run(path, "float32"):
            pytest.skip(cannot_run(path, "float32"))
    set_path(monkeypatch, "onednn")
    monkeypatch.delenv("MINIVLLM_CPU_GEMM")
    table = ("cpu_gemm", "onednn", "F.linear", "onednn", "cpu_gemm")
    monkeypatch.setattr(linear, "select_cpu_gemm_kinds", lambda weight, default: table)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 12, 30, 2)]  # prefills of 3..30 rows
    max_tokens = [9, 4, 7, 6]  # decode batches of 4, 3, 2, 1
    llm = LLM(tiny, dtype="float32", **ENGINE)
    assert linear_kinds(llm) == {"cpu_gemm/onednn/F.linear/onednn/cpu_gemm"}
    layers = [m for m in runner_of(llm).model.modules() if hasattr(m, "cpu_linear_kinds")]
    assert all(m.weight.numel() > 0 for m in layers)  # F.linear keeps the plain weight
    before = replays(llm)
    graphs = greedy(llm, prompts, max_tokens)
    assert replays(llm) > before
    assert graphs == greedy(LLM(tiny, dtype="float32", enforce_eager=True, **ENGINE), prompts, max_tokens)
    assert graphs == hf_greedy(tiny, prompts, max_tokens)


# The bfloat16 pairs kernel (kernels chapter 04, `vdpbf16ps`) is only ever chosen by measurement; forced here
# for every bucket so that it runs whatever this CPU measures: graphs == eager, the LM head included, and with
# AVX512-BF16 hidden the same table cannot be packed and falls back to F.linear (never an instruction the
# CPU view lacks).
def test_bf16_pairs_kernel_graphs_equal_eager(tiny, monkeypatch):
    from minivllm_kernels.cpu_gemm import cpu_gemm_bf16_dp_available
    from minivllm.model_executor.layers import linear
    if not cpu_gemm_bf16_dp_available():
        pytest.skip("the bfloat16 pairs kernel needs AVX512-BF16 (avx512_bf16), which this CPU lacks")
    set_path(monkeypatch, "onednn")
    monkeypatch.delenv("MINIVLLM_CPU_GEMM")
    table = ("cpu_gemm_bf16_dp",) * 5
    monkeypatch.setattr(linear, "select_cpu_gemm_kinds", lambda weight, default: table)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 21, 8, 13)]
    max_tokens = [10, 5, 8, 7]
    llm = LLM(tiny, dtype="bfloat16", **ENGINE)
    assert linear_kinds(llm) == {"cpu_gemm_bf16_dp"}
    before = replays(llm)
    graphs = greedy(llm, prompts, max_tokens)
    assert replays(llm) - before >= 6
    eager_llm = LLM(tiny, dtype="bfloat16", enforce_eager=True, **ENGINE)
    assert linear_kinds(eager_llm) == {"cpu_gemm_bf16_dp"}
    assert graphs == greedy(eager_llm, prompts, max_tokens)
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
    assert not cpu_gemm_bf16_dp_available()
    hidden = LLM(tiny, dtype="bfloat16", enforce_eager=True, **ENGINE)
    assert linear_kinds(hidden) == {None}  # F.linear


# The AMX kernel (kernels chapter 04, `tdpbf16ps` tiles) is chosen by measurement; forced here, first for
# every bucket, then mixed with the pairs kernel (both read one packed copy per layer): graphs == eager, and
# with AMX hidden the same table falls back to a kernel the view allows.
def test_bf16_amx_kernel_graphs_equal_eager(tiny, monkeypatch):
    from minivllm_kernels.cpu_gemm import cpu_gemm_bf16_amx_available, cpu_gemm_bf16_dp_available
    from minivllm.model_executor.layers import linear
    if not cpu_gemm_bf16_amx_available():
        pytest.skip("the AMX kernel needs amx_tile and amx_bf16 (Sapphire Rapids or later), which this CPU lacks")
    set_path(monkeypatch, "onednn")
    monkeypatch.delenv("MINIVLLM_CPU_GEMM")
    table = ["cpu_gemm_bf16_amx"] * 5
    monkeypatch.setattr(linear, "select_cpu_gemm_kinds", lambda weight, default: tuple(table))
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 21, 8, 13)]
    max_tokens = [10, 5, 8, 7]
    llm = LLM(tiny, dtype="bfloat16", **ENGINE)
    assert linear_kinds(llm) == {"cpu_gemm_bf16_amx"}
    before = replays(llm)
    graphs = greedy(llm, prompts, max_tokens)
    assert replays(llm) - before >= 6
    eager_llm = LLM(tiny, dtype="bfloat16", enforce_eager=True, **ENGINE)
    assert graphs == greedy(eager_llm, prompts, max_tokens)
    if cpu_gemm_bf16_dp_available():
        table[:2] = ["cpu_gemm_bf16_dp"] * 2
        mixed = LLM(tiny, dtype="bfloat16", enforce_eager=True, **ENGINE)
        assert linear_kinds(mixed) == {"/".join(table)}
        assert len(greedy(mixed, prompts, max_tokens)) == len(prompts)
        table[:2] = ["cpu_gemm_bf16_amx"] * 2
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
    assert not cpu_gemm_bf16_amx_available()
    hidden = LLM(tiny, dtype="bfloat16", enforce_eager=True, **ENGINE)
    assert linear_kinds(hidden) == {None}  # F.linear


def test_amx_kernel_shares_the_pairs_packing():
    "Both bfloat16 kernels that read weights by pairs get one packed copy, and the same product."
    from minivllm_kernels.cpu_gemm import cpu_gemm_bf16_amx_available, cpu_gemm_bf16_dp_available
    from minivllm.model_executor.layers.utils import cpu_gemm_candidates
    if not (cpu_gemm_bf16_amx_available() and cpu_gemm_bf16_dp_available()):
        pytest.skip("needs AMX (amx_tile, amx_bf16) and AVX512-BF16, which this CPU lacks")
    w = torch.randn(96, 64).bfloat16()
    impls = cpu_gemm_candidates(w, {"cpu_gemm_bf16_dp", "cpu_gemm_bf16_amx"})
    assert impls["cpu_gemm_bf16_dp"].packed is impls["cpu_gemm_bf16_amx"].packed
    x = torch.randn(20, 64).bfloat16()
    ref = x.float() @ w.float().T
    for fn in impls.values():
        assert torch.allclose(fn(x).float(), ref, rtol=1e-2, atol=0.1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_avx512_tiles_and_avx2_tiles_give_the_same_tokens(dtype, tiny, monkeypatch):
    """The C GEMM's 8x48 AVX-512 tiles (kernels chapter 04; bfloat16 from 7 rows on) run where the library has
    them and avx512f is in view; hiding avx512f runs the AVX2 tiles over the same panels. With graphs, both
    give the same tokens (the tiles' sums are bit-identical, checked per shape in the chapter), and in
    float32 those of transformers."""
    from minivllm_kernels.cpu_gemm import _gemm_fn

    lib = load_cpu_gemm_lib()
    if lib is None or not hasattr(lib, "gemm_f32_avx512") or "avx512f" not in cpu_flags():
        pytest.skip("the AVX-512 GEMM tiles need AVX-512F (avx512f), which this CPU or its build lacks")
    set_path(monkeypatch, "cpu_gemm")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 19, 9)]
    max_tokens = [9, 6, 8]
    suffix = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    assert _gemm_fn(lib, getattr(torch, dtype)) is getattr(lib, f"gemm_{suffix}_avx512")
    wide = greedy(LLM(tiny, dtype=dtype, **ENGINE), prompts, max_tokens)
    monkeypatch.setenv("MINIVLLM_CPU_FLAGS", "avx2,fma,f16c")
    assert _gemm_fn(lib, getattr(torch, dtype)) is getattr(lib, f"gemm_{suffix}")
    narrow_llm = LLM(tiny, dtype=dtype, **ENGINE)
    assert linear_kinds(narrow_llm) == {"cpu_gemm"}
    assert greedy(narrow_llm, prompts, max_tokens) == wide
    if dtype == "float32":
        assert wide == hf_greedy(tiny, prompts, max_tokens)


def test_cpu_linear_dispatches_on_the_rows_of_each_call(monkeypatch):
    from minivllm.model_executor.layers import linear
    from minivllm.model_executor.layers.utils import cpu_gemm_candidates
    if cannot_run("cpu_gemm", "float32") or cannot_run("onednn", "float32"):
        pytest.skip("needs the C GEMM and oneDNN")
    monkeypatch.delenv("MINIVLLM_CPU_GEMM", raising=False)
    monkeypatch.delenv("MINIVLLM_CPU_GEMM_TUNING", raising=False)
    table = ("F.linear", "cpu_gemm", "onednn", "cpu_gemm", "onednn")
    monkeypatch.setattr(linear, "select_cpu_gemm_kinds", lambda weight, default: table)
    calls = []

    def spying_candidates(weight, kinds):
        impls = cpu_gemm_candidates(weight, kinds)
        return {k: (lambda f, k: lambda x, bias=None: calls.append(k) or f(x, bias))(f, k) for k, f in impls.items()}

    monkeypatch.setattr(linear, "cpu_gemm_candidates", spying_candidates)
    layer = linear.ReplicatedLinear(48, 40, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert layer.cpu_linear_kinds == table and layer.weight.numel() > 0
    for rows, kind in ((1, "F.linear"), (3, "cpu_gemm"), (9, "onednn"), (40, "cpu_gemm"), (64, "cpu_gemm"), (65, "onednn"), (2048, "onednn")):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x)[0], torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
        assert calls[-1] == kind, (rows, calls[-1])


def test_measured_choice_under_each_cpu_view_stays_runnable(monkeypatch, tmp_path):
    "Whatever the timings say, a view's measured kinds are among the kernels that view allows."
    from minivllm.model_executor.layers import utils
    from minivllm.model_executor.layers.linear import RowParallelLinear
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINIVLLM_CPU_GEMM", raising=False)
    monkeypatch.delenv("MINIVLLM_CPU_GEMM_TUNING", raising=False)
    monkeypatch.setattr(utils, "_CHOICES", {})
    allowed = {"sse2": ({"onednn", "F.linear"}, {"F.linear"}), "avx2,fma": ({"cpu_gemm", "onednn", "F.linear"},
                                                                            {"cpu_gemm", "F.linear"})}
    if "avx512_bf16" in cpu_flags():  # the pairs kernel may win bfloat16 buckets only where the view shows it
        allowed["avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512_bf16"] = (
            {"cpu_gemm", "onednn", "F.linear"}, {"cpu_gemm", "cpu_gemm_bf16_dp", "onednn", "F.linear"})
    if {"amx_tile", "amx_bf16"} <= cpu_flags():  # and the AMX kernel only where the view shows AMX
        allowed["avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512_bf16,amx_tile,amx_bf16"] = (
            {"cpu_gemm", "onednn", "F.linear"},
            {"cpu_gemm", "cpu_gemm_bf16_dp", "cpu_gemm_bf16_amx", "onednn", "F.linear"})
    for flags, (f32, bf16) in allowed.items():
        monkeypatch.setenv("MINIVLLM_CPU_FLAGS", flags)
        for dtype, ok in ((torch.float32, f32), (torch.bfloat16, bf16)):
            layer = RowParallelLinear(64, 32, bias=False, params_dtype=dtype)
            torch.nn.init.normal_(layer.weight)
            layer.process_weights_after_loading()
            assert set(layer.cpu_linear_kinds) <= ok, (flags, dtype, layer.cpu_linear_kinds)
    assert list(tmp_path.glob("gemm/choices-*.json"))  # measured and kept


@pytest.fixture
def gemm_cache(monkeypatch, tmp_path):
    "A scratch MINIVLLM_CACHE_DIR (never the user's ~/.cache), an empty per-process memo, `auto` tuning."
    from minivllm.model_executor.layers import utils
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    for name in ("MINIVLLM_CPU_GEMM", "MINIVLLM_CPU_GEMM_TUNING", "MINIVLLM_CPU_ONEDNN_GEMM", "MINIVLLM_CPU_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(utils, "_CHOICES", {})
    monkeypatch.setattr(utils, "_machine_was_quiet", lambda: True)
    return utils


def test_gemm_cache_key_has_the_onednn_switch_and_the_compiler(gemm_cache, monkeypatch):
    utils = gemm_cache
    real_cc = utils.find_c_compiler
    on = utils.cpu_gemm_cache_path()
    monkeypatch.setattr(utils, "find_c_compiler", lambda: None)
    no_cc = utils.cpu_gemm_cache_path()
    monkeypatch.setattr(utils, "find_c_compiler", real_cc)
    monkeypatch.setenv("MINIVLLM_CPU_ONEDNN_GEMM", "0")
    off = utils.cpu_gemm_cache_path()
    assert len({on, off, no_cc}) == 3
    # three runs with oneDNN off freeze a table without oneDNN; a run with it on does not read that table
    w = torch.randn(64, 64) * 0.05
    for _ in range(3):
        utils._CHOICES.clear()
        utils.select_cpu_gemm_kinds(w, "onednn")
    frozen = utils._read_choices(off)["64x64:float32"]
    assert frozen["runs"] == 3 and "onednn" not in frozen["ms"]
    monkeypatch.delenv("MINIVLLM_CPU_ONEDNN_GEMM")
    utils._CHOICES.clear()
    utils.select_cpu_gemm_kinds(w, "onednn")
    fresh = utils._read_choices(on)["64x64:float32"]
    assert fresh["runs"] == 1
    if torch.backends.mkldnn.is_available():
        assert "onednn" in fresh["ms"]


@pytest.mark.parametrize("runs", [True, -5, 2.5, "3"])
def test_a_run_count_that_is_not_a_whole_number_is_measured_again(gemm_cache, runs):
    utils = gemm_cache
    path = utils.cpu_gemm_cache_path()
    path.parent.mkdir(parents=True)
    # F.linear looks 1000x faster than it is: if this entry were trusted, it would be the choice
    path.write_text(json.dumps({"64x64:float32": {"ms": {"F.linear": [1e-9] * 5}, "runs": runs}}))
    utils.select_cpu_gemm_kinds(torch.randn(64, 64) * 0.05, "onednn")
    entry = utils._read_choices(path)["64x64:float32"]
    assert entry["runs"] == 1 and type(entry["runs"]) is int  # measured again, counted from 0
    assert min(entry["ms"]["F.linear"]) > 1e-9


def test_a_folder_in_the_cache_files_place_leaves_no_tmp(gemm_cache):
    utils = gemm_cache
    path = utils.cpu_gemm_cache_path()
    path.mkdir(parents=True)
    kinds = utils.select_cpu_gemm_kinds(torch.randn(64, 64) * 0.05, "onednn")
    assert len(kinds) == 5 and path.is_dir()
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_cached_kind_that_cannot_be_packed_gives_way_to_the_next_best_measured(gemm_cache, monkeypatch):
    from minivllm.model_executor.layers.linear import RowParallelLinear
    utils = gemm_cache
    if cannot_run("cpu_gemm", "float32"):
        pytest.skip(cannot_run("cpu_gemm", "float32"))
    path = utils.cpu_gemm_cache_path()
    path.parent.mkdir(parents=True)
    ms = {"onednn": [1.0] * 5, "cpu_gemm": [2.0] * 5, "F.linear": [3.0] * 5}
    path.write_text(json.dumps({"32x64:float32": {"ms": ms, "runs": 3}}))  # final: read, not measured
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # oneDNN cannot pack here
    layer = RowParallelLinear(64, 32, bias=False, params_dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    w = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.cpu_linear_kinds == ("cpu_gemm",) * 5  # not F.linear, the slowest
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x)[0], torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
