"""The runner's CUDA-graph path (dispatch, padding, capture, replay) simulated on the CPU.

A CUDA graph replays the captured kernels against the same memory, so everything it reads must sit in
the runner's persistent buffers at fixed addresses, padded to the captured size. `FakeGraph` keeps exactly
that contract without a GPU: capture records the model call with its inputs (views of the persistent
buffers) and its forward context (the capture-time attention metadata, views of the same buffers), and
`replay` re-runs that call and copies the result into the captured output tensor. If the runner forgot to
pad a slot mapping, left stale request entries, or built metadata that is not a view of its buffers,
the replayed step would differ from the eager one. The Triton backend runs interpreted. On a real GPU
tests/test_triton_attention.py checks the same with torch.cuda.CUDAGraph.
"""
import contextlib
import os
import random

import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from minivllm.compilation_config import CompilationConfig, CUDAGraphMode  # noqa: E402
from minivllm.entrypoints.llm import LLM  # noqa: E402
from minivllm.forward_context import get_forward_context, set_forward_context  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.testing import make_tiny_checkpoint  # noqa: E402


class FakeGraph:
    recording: "FakeGraph | None" = None
    replays = 0

    def __init__(self): self.call = None

    def replay(self):
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
@pytest.mark.parametrize("mode,arch", [("FULL_DECODE_ONLY", "qwen3"), ("FULL", "qwen3"), ("FULL", "gemma3")])
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
    monkeypatch.setenv("MINIVLLM_CUDAGRAPH_MODE", "FULL")
    llm = LLM(tiny, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, device="cpu")
    runner = runner_of(llm)
    assert runner.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    assert runner.cudagraphs == {}  # CPU: nothing captured at start-up
    # pretending CUDA is not enough with a backend that cannot be captured (the torch reference)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    device, runner.device = runner.device, torch.device("cuda")
    try: assert runner.capture_model() == 0
    finally: runner.device = device
