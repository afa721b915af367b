"""CPU graphs in the engine (chapter 46b): decode steps replayed from recorded C kernel launches.

On the CPU the default `cudagraph_mode` is FULL_DECODE_ONLY and the runner has a `CPUGraph` per decode
batch size up to `max_num_seqs`, all in one shared `CPUGraphPool`: the largest is captured at start-up, each
other size in its first decode step (a CPU capture runs the pass). A replay re-issues the launches against the runner's persistent buffers, so any
step input that does not live there (a fresh tensor, a Python decision taken from the data) would make the
replayed step differ from the eager one. These tests run mixed-length prompts with different `max_tokens`
(decode batches shrink from 5 to 1 and are padded up to 8, 4, 2, 1), compare the tokens with eager runs and
with transformers, and check which setups fall back to eager.
"""
import logging
import random

import pytest
import torch
import transformers

from minivllm_kernels.cpu_attention import cpu_attention_available
from minivllm.compilation.cpu_graph import CPUGraph
from minivllm.compilation_config import CUDAGraphMode
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU graphs are the CPU's; CUDA has CUDA graphs"),
    pytest.mark.skipif(not cpu_attention_available(), reason="needs the C kernels (a C compiler)"),
]

_CKPTS = {}


def checkpoint(arch, tmp_path_factory):
    if arch not in _CKPTS:
        _CKPTS[arch] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
    return _CKPTS[arch]


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def greedy(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(path, prompts, max_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p, m in zip(prompts, max_tokens):
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                                 pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def replays(llm):
    "Decode steps that ran on a graph: replays, and the captures made in a step (all but the start-up one)."
    entries = runner_of(llm).cudagraphs.values()
    return sum(e.cudagraphs[0].num_replays for e in entries) + max(len(entries) - 1, 0)


def full_keys(llm):
    "The decode batch sizes the engine has graphs for (captured or to be captured in their first step)."
    return {k.num_tokens for k in runner_of(llm).cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL]}


ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


# gemma3: sliding-window layers next to full ones (two KV cache groups, two slot mappings to pad) and
# logit soft-capping; qwen3: q/k norms inside attention.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_cpu_graph_replay_equals_eager_and_transformers(arch, tmp_path_factory, monkeypatch):
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    path = checkpoint(arch, tmp_path_factory)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 6, 40, 9)]
    max_tokens = [9, 3, 14, 6, 11]
    llm = LLM(path, **ENGINE)
    runner = runner_of(llm)
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    keys = set(runner.cudagraphs)
    assert {k.num_tokens for k in keys} == {8} and all(k.uniform_decode for k in keys)  # the largest first
    assert full_keys(llm) == {1, 2, 4, 8}
    assert all(isinstance(e.cudagraphs[0], CPUGraph) and e.cudagraphs[0].num_launches > 0
               for e in runner.cudagraphs.values())
    before = replays(llm)
    graphs = greedy(llm, prompts, max_tokens)
    assert replays(llm) - before >= 10  # every decode step: 5 requests padded to 8, then 4, 2, 1
    assert {k.num_tokens for k in runner.cudagraphs} == {1, 2, 4, 8}  # captured in their first steps
    eager = greedy(LLM(path, enforce_eager=True, **ENGINE), prompts, max_tokens)
    assert graphs == eager
    if arch != "gemma3":  # gemma3 is compared with transformers in tests/test_gemma3.py
        assert graphs == hf_greedy(path, prompts, max_tokens)
    # stale padding from the larger steps must not leak into later, smaller ones: other prompts, same engine
    more = [[rng.randrange(3, 500) for _ in range(n)] for n in (12, 2, 30)]
    assert greedy(llm, more, [7, 7, 3]) == greedy(LLM(path, enforce_eager=True, **ENGINE), more, [7, 7, 3])


def test_cpu_graphs_fall_back_to_eager(tmp_path_factory, monkeypatch, caplog):
    path = checkpoint("llama", tmp_path_factory)
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    assert runner_of(LLM(path, enforce_eager=True, **ENGINE)).cudagraphs == {}
    with caplog.at_level(logging.INFO):
        llm = LLM(path, compilation_config={"cudagraph_mode": "PIECEWISE"}, **ENGINE)
    assert runner_of(llm).cudagraphs == {} and "no PIECEWISE" in caplog.text
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TORCH_REF")  # its metadata is not replayable
    caplog.clear()
    with caplog.at_level(logging.INFO):
        llm = LLM(path, **ENGINE)
    assert runner_of(llm).cudagraphs == {} and "an attention backend cannot be captured" in caplog.text
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 11)]
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND")
    assert greedy(llm, prompts, [6, 4]) == greedy(LLM(path, **ENGINE), prompts, [6, 4])


def test_cpu_graph_sizes_follow_the_config(tmp_path_factory, monkeypatch):
    path = checkpoint("llama", tmp_path_factory)
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    cc = {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 3]}
    llm = LLM(path, compilation_config=cc, **ENGINE)
    assert full_keys(llm) == {1, 3} and {k.num_tokens for k in runner_of(llm).cudagraphs} == {3}  # decode only
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    before = replays(llm)
    out = greedy(llm, prompts, [4, 4, 4])
    assert replays(llm) > before
    assert out == greedy(LLM(path, enforce_eager=True, **ENGINE), prompts, [4, 4, 4])


# bfloat16 brings torch ops that copy inside the graph: GemmaRMSNorm's .float() / .to(dtype), and with
# custom_ops "none" the PyTorch RMSNorm and RoPE (whose .to(query.dtype) carries this step's cos/sin). Under
# inference mode they reach the recorder undecomposed with a "may alias" schema; a replay that took them for
# views would reuse the capture-time copies (all-zero tokens, RoPE of position 0).
@pytest.mark.parametrize("arch,custom_ops", [("gemma3", []), ("llama", ["none"])])
def test_cpu_graphs_in_bfloat16_equal_eager(arch, custom_ops, tmp_path_factory, monkeypatch):
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    path = checkpoint(arch, tmp_path_factory)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 13, 7)]
    max_tokens = [10, 6, 8]
    kw = dict(ENGINE, dtype="bfloat16", compilation_config={"custom_ops": custom_ops})
    llm = LLM(path, **kw)
    assert runner_of(llm).cudagraphs
    before = replays(llm)
    graphs = greedy(llm, prompts, max_tokens)
    assert replays(llm) > before
    cc = {"custom_ops": custom_ops, "cudagraph_mode": "NONE"}
    assert graphs == greedy(LLM(path, **dict(kw, compilation_config=cc)), prompts, max_tokens)


def _opaque_weight(w):
    "oneDNN's packed copy of w; `to_mkldnn()` where this CPU's reorder happens to return a dense tensor."
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    return packed if packed.is_mkldnn else w.to_mkldnn()


# The oneDNN linears (the default on AVX-512 CPUs) multiply by an opaque mkldnn tensor, which has no storage;
# the recorder asked every tensor for one and killed start-up ("Cannot access storage of OpaqueTensorImpl").
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_cpu_graph_records_onednn_linear_on_opaque_weights():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    packed = _opaque_weight(w)
    assert packed.is_mkldnn
    x = torch.zeros(3, 16)  # persistent input
    graph = CPUGraph()
    with torch.inference_mode():
        graph.capture_begin()
        try:
            y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "").relu()
        finally:
            graph.capture_end()
        assert graph.num_torch_ops == 2  # the oneDNN linear and the relu, both re-run at replay
        for _ in range(2):
            x.copy_(torch.randn(3, 16, generator=g))
            graph.replay()
            torch.testing.assert_close(y, torch.relu(x @ w.T + b), rtol=1e-5, atol=1e-5)
    assert graph.num_replays == 2


# Any exception while capturing, not only the recorder's own refusal, must leave start-up working: one warning
# naming the cause, no graphs, no recorder left active on this thread, the same tokens as eager.
def test_capture_failure_falls_back_to_eager(tmp_path_factory, monkeypatch, caplog):
    from minivllm_kernels import cpu_build
    from minivllm.compilation import cpu_graph

    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    path = checkpoint("llama", tmp_path_factory)
    real_dispatch = cpu_graph._TorchOpRecorder.__torch_dispatch__
    seen = []

    def failing_dispatch(self, func, types, args=(), kwargs=None):
        seen.append(func)
        if len(seen) == 5:  # in the middle of the first captured pass
            raise KeyError("injected capture failure")
        return real_dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(cpu_graph._TorchOpRecorder, "__torch_dispatch__", failing_dispatch)
    with caplog.at_level(logging.WARNING):
        llm = LLM(path, **ENGINE)
    assert len(seen) == 5 and runner_of(llm).cudagraphs == {}
    warnings = [r for r in caplog.records if "no CPU graphs" in r.getMessage()]
    assert len(warnings) == 1 and "KeyError: 'injected capture failure'" in warnings[0].getMessage()
    assert torch._C._len_torch_dispatch_stack() == 0 and cpu_build._LAUNCH_RECORDERS.stack == []
    monkeypatch.setattr(cpu_graph._TorchOpRecorder, "__torch_dispatch__", real_dispatch)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 15)]
    assert greedy(llm, prompts, [7, 5]) == greedy(LLM(path, enforce_eager=True, **ENGINE), prompts, [7, 5])


def test_cpu_graphs_past_32_sequences_share_one_pool(tmp_path_factory, monkeypatch, caplog):
    "44 sequences: decode batches from 44 down to 1 run on graphs of sizes up to 48, all in one pool."
    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    monkeypatch.delenv("MINIVLLM_CPU_GRAPH_POOL", raising=False)
    path = checkpoint("llama", tmp_path_factory)
    engine = dict(dtype="float32", max_model_len=64, max_num_seqs=48, max_num_batched_tokens=256)
    with caplog.at_level(logging.INFO):
        llm = LLM(path, **engine)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU graphs (")]
    assert "decode batch sizes 1, 2, 4, 8..48 (step 8)" in line and "size 48 captured at start-up" in line
    assert "every decode step (at most 48 tokens) is padded" in line
    runner = runner_of(llm)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 12))] for _ in range(44)]
    max_tokens = [rng.randint(2, 9) for _ in prompts]
    graphs = greedy(llm, prompts, max_tokens)
    used = {k.num_tokens for k, e in runner.cudagraphs.items()}
    assert {48, 40} <= used  # batches of 33..44 sequences ran on graphs
    entries = [e.cudagraphs[0] for e in runner.cudagraphs.values()]
    pool = entries[0].pool
    assert pool is not None and all(g.pool is pool for g in entries)
    assert pool.num_unplaced == 0 and all(g.nbytes == 0 for g in entries)  # one step's memory for all sizes
    assert graphs == greedy(LLM(path, enforce_eager=True, **engine), prompts, max_tokens)
    assert graphs == hf_greedy(path, prompts, max_tokens)
    # the same sizes, each graph with its own memory: the pool holds what the largest one alone holds
    monkeypatch.setenv("MINIVLLM_CPU_GRAPH_POOL", "0")
    own = LLM(path, **engine)
    assert greedy(own, prompts, max_tokens) == graphs
    own_bytes = {k.num_tokens: e.cudagraphs[0].nbytes for k, e in runner_of(own).cudagraphs.items()}
    assert own_bytes.keys() == used and pool.nbytes == own_bytes[48] < sum(own_bytes.values())


def test_a_capture_failing_in_a_decode_step_runs_that_step_eagerly(tmp_path_factory, monkeypatch, caplog):
    "Sizes are captured in their first decode step: a capture failing midway there must not fail the step."
    from minivllm.compilation import cpu_graph

    monkeypatch.delenv("MINIVLLM_CUDAGRAPH_MODE", raising=False)
    path = checkpoint("llama", tmp_path_factory)
    llm = LLM(path, **ENGINE)  # size 8 captured at start-up
    wrapper = runner_of(llm).cudagraph_model
    real_dispatch = cpu_graph._TorchOpRecorder.__torch_dispatch__
    calls = []

    def failing_dispatch(self, func, types, args=(), kwargs=None):
        calls.append(func)
        if len(calls) % 5 == 0:  # in the middle of each captured pass, after some launches ran
            raise KeyError("injected capture failure")
        return real_dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(cpu_graph._TorchOpRecorder, "__torch_dispatch__", failing_dispatch)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 9, 3)]
    max_tokens = [8, 5, 3]  # decode batches of 3, 2, 1: sizes 4, 2, 1, none captured yet
    with caplog.at_level(logging.WARNING):
        got = greedy(llm, prompts, max_tokens)
    assert {k.num_tokens for k in wrapper.eager_keys} == {1, 2, 4}
    assert {k.num_tokens for k in runner_of(llm).cudagraphs} == {8}  # only the start-up capture
    assert sum("graph capture of" in r.getMessage() and "injected" in r.getMessage() for r in caplog.records) == 3
    monkeypatch.setattr(cpu_graph._TorchOpRecorder, "__torch_dispatch__", real_dispatch)
    assert got == greedy(LLM(path, enforce_eager=True, **ENGINE), prompts, max_tokens)
    assert greedy(llm, prompts, max_tokens) == got  # the eager sizes stay eager, size 8 still replays
