"""The runner's CUDA-graph path (dispatch, padding, capture, replay) simulated on the CPU.

A CUDA graph replays the captured kernels against the same memory, so everything it reads must sit in
the runner's persistent buffers at fixed addresses, padded to the captured size. `FakeGraph` keeps exactly
that contract without a GPU: capture records the model call with its inputs (views of the persistent
buffers) and its forward context (the capture-time attention metadata, views of the same buffers), and
`replay` re-runs that call and copies the result into the captured output tensor. If the runner forgot to
pad a slot mapping, left stale request entries, or built metadata that is not a view of its buffers,
the replayed step would differ from the eager one. The Triton backend runs interpreted. On a real GPU
tests/test_triton_attention.py checks the same with torch.cuda.CUDAGraph.

PIECEWISE pieces are captured with `capture_begin` / `capture_end` around the model code between attention
layers; there `FakeGraph` is minivllm's `RecordingGraph`, which records the aten ops of the piece and replays
them on the same tensors (attention, the only Triton code, is never inside a piece).
"""
import contextlib
import os
import random

import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from minivllm.compilation.cuda_graph import CUDAGraphEntry, RecordingGraph  # noqa: E402
from minivllm.compilation_config import CompilationConfig, CUDAGraphMode  # noqa: E402
from minivllm.entrypoints.llm import LLM  # noqa: E402
from minivllm.forward_context import get_forward_context, set_forward_context  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.testing import make_tiny_checkpoint  # noqa: E402


class FakeGraph(RecordingGraph):
    "FULL: records the model call (torch.cuda.graph context); PIECEWISE pieces: RecordingGraph's aten ops."
    recording: "FakeGraph | None" = None
    replays = 0

    def __init__(self):
        super().__init__()
        self.call = None

    def replay(self):
        if self.call is None: return super().replay()
        forward, args, ctx, out = self.call
        with set_forward_context(ctx.attn_metadata, None, slot_mapping=ctx.slot_mapping, batch_descriptor=ctx.batch_descriptor):
            out.copy_(forward(*args))
        FakeGraph.replays += 1


@contextlib.contextmanager
def fake_graph(graph, pool=None):
    FakeGraph.recording = graph
    try: yield
    finally: FakeGraph.recording = None


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def capture_fake(runner, monkeypatch, mode, sizes):
    "Capture FakeGraphs on the CPU runner: CUDA pretended for the duration of capture_model only."
    forward = runner.model.forward

    def recording_forward(input_ids, positions, *a, **k):
        out = forward(input_ids, positions, *a, **k)
        if FakeGraph.recording is not None:
            FakeGraph.recording.call = (forward, (input_ids, positions), get_forward_context(), out)
        return out

    monkeypatch.setattr(runner.model, "forward", recording_forward)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    runner.vllm_config.compilation_config = CompilationConfig(mode, cudagraph_capture_sizes=sizes)
    device, runner.device = runner.device, torch.device("cuda")
    try: n = runner.capture_model()
    finally: runner.device = device
    return n


def greedy(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


_CKPTS = {}


def checkpoint(arch, tmp_path_factory):
    if arch not in _CKPTS: _CKPTS[arch] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
    return _CKPTS[arch]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return checkpoint("qwen3", tmp_path_factory)


# gemma3: a sliding-window KV cache group next to a full one, so two slot mappings to pad
@pytest.mark.parametrize("mode,arch", [("FULL_DECODE_ONLY", "qwen3"),  # FULL: 14 s each on a 2-core CPU
                                       pytest.param("FULL", "qwen3", marks=pytest.mark.slow),
                                       pytest.param("FULL", "gemma3", marks=pytest.mark.slow)])
def test_fake_cudagraph_replay_equals_eager(tmp_path_factory, monkeypatch, mode, arch):
    if torch.cuda.is_available(): pytest.skip("the real thing runs in tests/test_triton_attention.py")
    tiny = checkpoint(arch, tmp_path_factory)
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 11, 6)]
    max_tokens = [5, 3, 6]
    llm = LLM(tiny, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    eager = greedy(llm, prompts, max_tokens)
    runner = runner_of(llm)
    assert len(runner.attn_groups) == (2 if arch == "gemma3" else 1)  # KV cache groups
    n = capture_fake(runner, monkeypatch, mode, [1, 2, 4, 8, 16, 32])
    keys = set(runner.cudagraphs)
    if mode == "FULL_DECODE_ONLY":  # decode keys only, never more requests than max_num_seqs
        assert n == 3 and all(k.uniform_decode for k in keys) and {k.num_tokens for k in keys} == {1, 2, 4}
    else:
        # sizes stop at min(2 * max_num_seqs, max_num_batched_tokens) = 8; one routine for all batches
        assert n == 4 and not any(k.uniform_decode for k in keys) and {k.num_tokens for k in keys} == {1, 2, 4, 8}
    FakeGraph.replays = 0
    assert greedy(llm, prompts, max_tokens) == eager
    assert FakeGraph.replays >= 5  # the decode steps (3 requests -> padded to 4, then 2, then 1)
    # stale padding entries from earlier, larger steps must not leak into later ones: run again, other prompts
    more = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 2)]
    FakeGraph.replays = 0
    assert greedy(llm, more, [4, 4]) == greedy(LLM(tiny, dtype="float32", max_model_len=64, max_num_seqs=4,
                                                   max_num_batched_tokens=32), more, [4, 4])
    assert FakeGraph.replays > 0


def test_capture_is_a_no_op_without_cuda_or_graph_mode(tiny, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TORCH_REF")
    monkeypatch.setenv("MINIVLLM_CUDAGRAPH_MODE", "FULL_DECODE_ONLY")
    llm = LLM(tiny, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, device="cpu")
    runner = runner_of(llm)
    assert runner.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert runner.cudagraphs == {}  # CPU: nothing captured at start-up
    # pretending CUDA is not enough with a backend that cannot be captured (the torch reference): a
    # decode-only full mode has no piecewise half to fall back to
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    device, runner.device = runner.device, torch.device("cuda")
    try: assert runner.capture_model() == 0
    finally: runner.device = device


class ReplayCounter:
    "Counts entry replays by runtime mode (a PIECEWISE entry has attention splits, a FULL one none)."
    def __init__(self, monkeypatch):
        self.counts = {"FULL": 0, "PIECEWISE": 0}
        real = CUDAGraphEntry.replay

        def replay(entry):
            self.counts["PIECEWISE" if entry.splits else "FULL"] += 1
            return real(entry)
        monkeypatch.setattr(CUDAGraphEntry, "replay", replay)


def attention_rows(runner):
    "Record, for every attention call, (rows given, the metadata's num_actual_tokens)."
    calls = []
    for layer in runner.get_attention_layers().values():
        def hook(layer, args):
            md = get_forward_context().attn_metadata
            if md is not None: calls.append((args[0].shape[0], md[layer.layer_name].num_actual_tokens))
        layer.register_forward_pre_hook(hook)  # the LLM is the test's own: no need to remove it
    return calls


def kv_caches(runner):
    return [t.clone() for t in runner.kv_caches]


# PIECEWISE works with any backend (attention runs eagerly between the pieces): the torch reference here,
# and gemma3 adds a second KV cache group. FULL_AND_PIECEWISE needs the capturable Triton backend for its
# FULL half. max_num_batched_tokens=8 chunks the prompts, so many steps are mixed and fit the sizes (<= 8).
# The gemma3 and Triton cases are the slowest of the suite on a 2-core CPU (25 s each, Triton interpreted):
# `-m slow` runs them; the default suite keeps the qwen3 torch-reference case (and the FULL cases above).
@pytest.mark.parametrize("mode,arch,backend", [("PIECEWISE", "qwen3", "TORCH_REF"),
                                               pytest.param("PIECEWISE", "gemma3", "TORCH_REF", marks=pytest.mark.slow),
                                               pytest.param("FULL_AND_PIECEWISE", "qwen3", "TRITON_ATTN",
                                                            marks=pytest.mark.slow)])
def test_fake_piecewise_replay_equals_eager(tmp_path_factory, monkeypatch, mode, arch, backend):
    if torch.cuda.is_available(): pytest.skip("the real thing runs in tests/test_triton_attention.py")
    tiny = checkpoint(arch, tmp_path_factory)
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", backend)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 11, 6)]
    max_tokens = [5, 3, 6]
    # custom_ops none and MINIVLLM_CPU_GEMM=0: the recording stand-in sees aten ops only, not the CPU-only C kernels
    # of the custom ops and linears (on CUDA, forward_cuda is the torch code, so this is what a real capture records)
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", "0")
    kw = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              compilation_config={"custom_ops": ["none"]})
    eager_llm = LLM(tiny, **kw)
    eager = greedy(eager_llm, prompts, max_tokens)
    llm = LLM(tiny, **kw)
    runner = runner_of(llm)
    n = capture_fake(runner, monkeypatch, mode, [1, 2, 4, 8])
    keys = set(runner.cudagraphs)
    pw = runner.cudagraph_wrappers[CUDAGraphMode.PIECEWISE].concrete_cudagraph_entries
    assert {k.num_tokens for k in pw} == {1, 2, 4, 8} and not any(k.uniform_decode for k in pw)
    num_layers = len(runner.get_attention_layers())
    assert all(len(e.cudagraphs) == num_layers + 1 and len(e.splits) == num_layers for e in pw.values())
    if mode == "FULL_AND_PIECEWISE":  # uniform-decode keys are FULL graphs, at most max_num_seqs requests
        assert n == 7 and {k for k in keys if k.uniform_decode} == {(1, 1, True), (2, 2, True), (4, 4, True)}
    else:
        assert n == 4 and CUDAGraphMode.FULL not in runner.cudagraph_wrappers
    counter = ReplayCounter(monkeypatch)
    calls = attention_rows(runner)
    assert greedy(llm, prompts, max_tokens) == eager
    assert counter.counts["PIECEWISE"] >= 3, counter.counts  # mixed steps of <= 8 tokens replayed the pieces
    if mode == "FULL_AND_PIECEWISE": assert counter.counts["FULL"] >= 3, counter.counts  # the decodes
    # attention saw exactly the real tokens of each step, never the padding (so padding reached no cache slot)
    assert calls and all(rows == n for rows, n in calls)
    # ... and the caches hold the same entries as the eager engine's (same schedule, same blocks)
    for ours, ref in zip(kv_caches(runner), kv_caches(runner_of(eager_llm))):
        assert torch.equal(ours != 0, ref != 0)
        assert torch.allclose(ours, ref, atol=1e-4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_gpu_cudagraph_modes_equal_eager_and_torch_ref(arch, tmp_path_factory, monkeypatch):
    """Real torch.cuda.CUDAGraph: greedy tokens with FULL, PIECEWISE and FULL_AND_PIECEWISE equal eager's (Triton)
    and the torch reference's. max_num_batched_tokens=16 keeps every step within the capture sizes (1..16), so
    prefill chunks replay the pieces and decodes the full graphs."""
    import gc
    tiny = checkpoint(arch, tmp_path_factory)
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 19, 9, 33, 2, 12)]
    max_tokens = [24, 7, 16, 3, 20, 12]
    kw = dict(dtype="float32", max_model_len=128, device="cuda", kv_cache_memory_bytes=1 << 28, max_num_seqs=8,
              max_num_batched_tokens=16)

    def run(backend, **extra):
        monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", backend)
        llm = LLM(tiny, **kw, **extra)
        out = greedy(llm, prompts, max_tokens)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return out

    ref = run("TORCH_REF", enforce_eager=True)
    assert run("TRITON_ATTN", enforce_eager=True) == ref
    counter = ReplayCounter(monkeypatch)
    for backend, mode in [("TRITON_ATTN", "FULL"), ("TRITON_ATTN", "PIECEWISE"), ("TRITON_ATTN", "FULL_AND_PIECEWISE"),
                          ("TORCH_REF", "PIECEWISE")]:  # attention is never inside a piece: any backend works
        counter.counts = {"FULL": 0, "PIECEWISE": 0}
        assert run(backend, compilation_config={"cudagraph_mode": mode}) == ref, (backend, mode)
        if "PIECEWISE" in mode: assert counter.counts["PIECEWISE"] > 0, (backend, mode, counter.counts)
        if "FULL" in mode: assert counter.counts["FULL"] > 0, (backend, mode, counter.counts)
