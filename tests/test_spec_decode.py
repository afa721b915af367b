"""Speculative decoding end to end (issue 33): greedy tokens with drafts == without == transformers.

Tiny random-weight checkpoints from `minivllm.testing`. The n-gram proposer gets prompts that repeat themselves
(so drafts are proposed and some accepted) next to prompts that never do (no drafts: the back-off); the
draft-model proposer runs a different tiny random model, and the target as its own draft, which must accept
every greedy proposal. Every engine here runs with the KV cache invariant checker on
(MINIVLLM_CHECK_INVARIANTS=1: after each step, block ref counts, free queue, and every request's blocks
covering its computed tokens).
"""
import random

import pytest
import torch
import transformers

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint

MAX_MODEL_LEN = 256


@pytest.fixture(autouse=True)
def _invariants(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CHECK_INVARIANTS", "1")


def _prompts(seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, 500) for _ in range(10)]
    return [
        base * 3,  # repeats: the n-gram proposer finds matches
        [rng.randrange(3, 500) for _ in range(21)],  # random: few or no matches
        base[:4] * 5 + [7, 8],
        [rng.randrange(3, 500) for _ in range(6)] * 2,
    ], [40, 23, 31, 18]


def hf_greedy(model, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    "(checkpoint path, prompts, max_tokens, transformers' greedy tokens)."
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("target"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts, max_tokens = _prompts()
    with torch.no_grad():
        expected = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    return path, prompts, max_tokens, expected


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    "A different tiny random Llama with the same vocabulary (another seed, one layer)."
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft"), seed=1, num_hidden_layers=1)


def make_llm(path, **kw):
    kw.setdefault("disable_log_stats", False)
    kw.setdefault("num_gpu_blocks_override", 64)  # a small pool keeps the per-step invariant check quick
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, **kw)
    assert core(llm).scheduler.update_from_output.__name__ == "traced_update"  # the checker runs each step
    return llm


def generate(llm, prompts, max_tokens, **sp):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, **sp) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def core(llm):
    return llm.llm_engine.engine_core.engine_core


def runner(llm):
    return core(llm).model_executor.driver_worker.model_runner


class StatsTap:
    "Collects every SchedulerStats.spec_decoding_stats the scheduler reports."

    def __init__(self, llm):
        self.stats = []
        sched = core(llm).scheduler
        make_stats = sched.make_stats

        def tapped():
            s = make_stats()
            if s is not None and s.spec_decoding_stats is not None:
                self.stats.append(s.spec_decoding_stats)
            return s

        sched.make_stats = tapped

    def totals(self):
        drafts = sum(s.num_drafts for s in self.stats)
        draft_tokens = sum(s.num_draft_tokens for s in self.stats)
        accepted = sum(s.num_accepted_tokens for s in self.stats)
        return drafts, draft_tokens, accepted


def ngram(k, lo=1, hi=3):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def assert_no_blocks_held(llm):
    kvm = core(llm).scheduler.kv_cache_manager
    pool = kvm.block_pool
    assert not core(llm).scheduler.requests
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_ngram_greedy_equals_transformers(target, k):
    path, prompts, max_tokens, expected = target
    llm = make_llm(path, speculative_config=ngram(k))
    tap = StatsTap(llm)
    got, _ = generate(llm, prompts, max_tokens)
    assert got == expected
    drafts, draft_tokens, accepted = tap.totals()
    assert drafts > 0 and draft_tokens >= drafts  # drafts were proposed and verified
    assert runner(llm).num_spec_steps > 0
    assert_no_blocks_held(llm)


def test_draft_model_greedy_equals_transformers(target, draft_path):
    path, prompts, max_tokens, expected = target
    for k in (1, 3):
        llm = make_llm(path, speculative_config={"model": draft_path, "num_speculative_tokens": k})
        tap = StatsTap(llm)
        got, _ = generate(llm, prompts, max_tokens)
        assert got == expected, k
        drafts, draft_tokens, accepted = tap.totals()
        assert drafts > 0 and accepted < draft_tokens  # a different model: some drafts are rejected
        assert_no_blocks_held(llm)


@pytest.mark.parametrize("k", [2, 5])
def test_target_as_its_own_draft_accepts_everything(target, k):
    path, prompts, max_tokens, expected = target
    llm = make_llm(path, speculative_config={"model": path, "num_speculative_tokens": k})
    tap = StatsTap(llm)
    got, _ = generate(llm, prompts, max_tokens)
    assert got == expected
    drafts, draft_tokens, accepted = tap.totals()
    assert drafts > 0 and accepted == draft_tokens
    per_pos = [sum(s.num_accepted_tokens_per_pos[i] for s in tap.stats) for i in range(k)]
    assert per_pos[0] == drafts  # every draft's first token accepted
    # each verifying step gives k + 1 tokens, so far fewer steps than tokens
    assert runner(llm).num_spec_steps < sum(max_tokens) / 2
    # the draft keeps its own KV cache in the target's block tables: each token goes through it about once
    # (prompt, outputs, and k - 1 one-token forwards per proposal), not the whole context per draft token
    drafter = runner(llm).drafter
    assert drafter.kv_mode is True
    fed = sum(len(p) + m for p, m in zip(prompts, max_tokens))
    assert drafter.num_draft_forward_tokens < fed + (k - 1) * drafts + drafts


SETTINGS = {
    "chunked_prefill": dict(max_num_batched_tokens=16),  # prompts split, drafts cut by the budget
    "preemption": dict(num_gpu_blocks_override=9, block_size=16),  # too few blocks for all four
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "max_num_seqs_2": dict(max_num_seqs=2),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_ngram_under_engine_settings(target, setting):
    path, prompts, max_tokens, expected = target
    llm = make_llm(path, speculative_config=ngram(3), **SETTINGS[setting])
    tap = StatsTap(llm)
    got, _ = generate(llm, prompts, max_tokens)
    assert got == expected
    assert tap.totals()[0] > 0
    if setting == "preemption":
        assert core(llm).scheduler.num_preemptions > 0
    assert_no_blocks_held(llm)


def test_target_draft_with_preemption_and_chunking(target):
    path, prompts, max_tokens, expected = target
    llm = make_llm(
        path,
        speculative_config={"model": path, "num_speculative_tokens": 4},
        num_gpu_blocks_override=9,
        max_num_batched_tokens=32,
    )
    got, _ = generate(llm, prompts, max_tokens)
    assert got == expected
    assert core(llm).scheduler.num_preemptions > 0
    assert_no_blocks_held(llm)


def test_max_tokens_inside_an_accepted_run(target):
    "With every draft accepted (k = 4: 5 tokens per step), max_tokens that are not multiples of 5 still hold."
    path, prompts, _, expected = target
    llm = make_llm(path, speculative_config={"model": path, "num_speculative_tokens": 4})
    max_tokens = [1, 2, 7, 13]
    got, outs = generate(llm, prompts, max_tokens)
    assert got == [e[:m] for e, m in zip(expected, max_tokens)]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_stop_token_and_stop_string_inside_an_accepted_run(target):
    path, prompts, max_tokens, expected = target
    ref_llm = make_llm(path)
    _, ref_outs = generate(ref_llm, prompts, max_tokens)
    spec_llm = make_llm(path, speculative_config={"model": path, "num_speculative_tokens": 4})
    # a stop token id met mid-way through the first prompt's output
    stop_id = expected[0][9]
    ref, _ = generate(ref_llm, prompts, max_tokens, stop_token_ids=[stop_id])
    got, outs = generate(spec_llm, prompts, max_tokens, stop_token_ids=[stop_id])
    assert got == ref
    assert got[0] == expected[0][: expected[0].index(stop_id) + 1]
    # a stop string: a piece of the reference text of prompt 0 around token 11
    text = ref_outs[0].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    ref_s, ref_so = generate(ref_llm, prompts, max_tokens, stop=[stop])
    got_s, got_so = generate(spec_llm, prompts, max_tokens, stop=[stop])
    # the text stops where it does without drafts; as in vLLM, the token ids of the step that completed the
    # stop string are all reported (the detokenizer finds stop strings after a whole step's tokens)
    assert [o.outputs[0].text for o in got_so] == [o.outputs[0].text for o in ref_so]
    assert [o.outputs[0].finish_reason for o in got_so] == [o.outputs[0].finish_reason for o in ref_so]
    for g, r in zip(got_s, ref_s):
        assert g[: len(r)] == r and len(g) <= len(r) + 4
    assert got_so[0].outputs[0].finish_reason == "stop"
    assert_no_blocks_held(spec_llm)


def test_prefix_caching_still_hits(target):
    path, prompts, max_tokens, expected = target
    llm = make_llm(path, speculative_config=ngram(3))
    generate(llm, prompts[:1], max_tokens[:1])
    got, outs = generate(llm, prompts[:1], max_tokens[:1])
    assert got == expected[:1]
    assert outs[0].num_cached_tokens >= 16  # the 30-token prompt's first full block at least
    assert_no_blocks_held(llm)


def test_unsupported_sampling_features_decode_without_drafts(target):
    "A request with penalties, logprobs, min_tokens ... gets no drafts; its tokens are those without speculation."
    path, prompts, max_tokens, _ = target
    ref_llm = make_llm(path)
    spec_llm = make_llm(path, speculative_config=ngram(3))
    for sp in (dict(logprobs=2), dict(repetition_penalty=1.3), dict(min_tokens=5)):
        ref, _ = generate(ref_llm, prompts, max_tokens, **sp)
        tap = StatsTap(spec_llm)
        got, _ = generate(spec_llm, prompts, max_tokens, **sp)
        assert got == ref, sp
        assert tap.totals()[0] == 0, sp


@pytest.mark.parametrize("draft", ["ngram", "own"])
def test_structured_outputs_with_drafts(target, draft):
    "Drafts of a constrained request are cut to what its grammar accepts and every draft position is masked."
    path, prompts, _, _ = target
    from minivllm.sampling_params import StructuredOutputsParams

    spec = ngram(3) if draft == "ngram" else {"model": path, "num_speculative_tokens": 3}
    ref_llm = make_llm(path)
    spec_llm = make_llm(path, speculative_config=spec)
    cases = [
        StructuredOutputsParams(regex="(ab|cd){4,12}"),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        StructuredOutputsParams(choice=["alpha beta gamma", "delta epsilon"]),
    ]
    for so in cases:
        ref, ref_outs = generate(ref_llm, prompts[:2], [24, 24], structured_outputs=so)
        tap = StatsTap(spec_llm)
        got, outs = generate(spec_llm, prompts[:2], [24, 24], structured_outputs=so)
        assert got == ref, so
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref_outs]
        if draft == "ngram" and so.regex:
            assert tap.totals()[0] > 0  # drafts the grammar accepts were verified under its masks
        # (the target as its own draft proposes without the grammar: such drafts are cut, often to none)
    assert_no_blocks_held(spec_llm)


def test_seeded_random_sampling_with_drafts_is_reproducible(target):
    path, prompts, max_tokens, _ = target
    llm = make_llm(path, speculative_config={"model": path, "num_speculative_tokens": 3})

    def run(seed):
        params = [SamplingParams(temperature=0.8, top_k=20, seed=seed, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert [len(x) for x in a] == max_tokens


def test_bad_speculative_config_is_refused(target):
    path = target[0]
    cases = [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"model": "/no/such/folder", "num_speculative_tokens": 2}, "speculative_config.model"),
        ('{"num_speculative_tokens": ', "not valid JSON"),
    ]
    for cfg, field in cases:
        with pytest.raises(ValueError, match=field):
            make_llm(path, speculative_config=cfg)
    with pytest.raises(ValueError, match="async_scheduling"):
        make_llm(path, speculative_config=ngram(2), async_scheduling=True)


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = make_tiny_checkpoint("llama", tmp_path / "other", vocab_size=384)
    with pytest.raises(ValueError, match="speculative_config.model"):
        make_llm(target[0], speculative_config={"model": other, "num_speculative_tokens": 2})


def test_cli_flag_parses():
    import argparse

    from minivllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    sc = EngineArgs.from_cli_args(args).create_speculative_config(None, __import__("minivllm.config").config.ParallelConfig())
    assert (sc.method, sc.num_speculative_tokens, sc.prompt_lookup_min) == ("ngram", 4, 5)


def test_metrics_on_prometheus(target):
    "The scheduler's SpecDecodingStats reach vllm:spec_decode_* through PrometheusStatLogger (what /metrics serves)."
    from minivllm.v1.metrics.loggers import PrometheusStatLogger

    path, prompts, max_tokens, _ = target
    llm = make_llm(path, speculative_config={"model": path, "num_speculative_tokens": 3})
    prom = PrometheusStatLogger("tiny")
    assert b"spec_decode" not in prom.generate()  # none before the first draft, as in vLLM
    sched = core(llm).scheduler
    make_stats = sched.make_stats
    seen = []

    def tapped():
        s = make_stats()
        prom.record(s, None)
        seen.append(s.spec_decoding_stats)
        return s

    sched.make_stats = tapped
    generate(llm, prompts, max_tokens)
    drafts = sum(s.num_drafts for s in seen if s)
    accepted = sum(s.num_accepted_tokens for s in seen if s)
    text = prom.generate().decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(drafts)}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(accepted)}' in text  # all accepted
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(accepted)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in text
    # the dict form a SchedulerStats takes across the engine-core process boundary is accepted too
    first = next(x for x in seen if x)
    prom.record(_as_wire(first), None)
    again = prom.generate().decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(drafts + first.num_drafts)}' in again


def _as_wire(stats):
    "A SchedulerStats-like object whose spec_decoding_stats is the msgpack-decoded dict."
    import msgspec

    from minivllm.v1.metrics.stats import SchedulerStats

    d = msgspec.msgpack.decode(msgspec.msgpack.encode(stats))
    return SchedulerStats(spec_decoding_stats=d)


def test_step_trace_records_acceptance(target, tmp_path):
    from minivllm.v1.engine.step_trace import load_step_trace

    path, prompts, max_tokens, _ = target
    trace = tmp_path / "trace.jsonl"
    llm = make_llm(path, speculative_config={"model": path, "num_speculative_tokens": 3}, trace_steps=str(trace))
    generate(llm, prompts, max_tokens)
    core(llm).step_tracer.close()
    steps = load_step_trace(str(trace))
    spec_steps = [s for s in steps if s.draft_tokens]
    assert spec_steps and all(s.acceptance_rate is not None for s in spec_steps)
    # the target as its own draft: every verified draft kept (drafts never reach past max_tokens)
    assert all(s.num_accepted_tokens == sum(s.draft_tokens.values()) for s in spec_steps)
    assert all(s.acceptance_rate is None for s in steps if not s.draft_tokens)


def test_backoff_when_drafts_keep_failing(target):
    "A proposer whose drafts are always rejected: the request pauses (2, 4, 8 ... steps); tokens unchanged."
    path, prompts, max_tokens, expected = target
    llm = make_llm(path, speculative_config=ngram(3))
    never = next(t for t in range(3, 512) if all(t not in e for e in expected))
    drafter = runner(llm).drafter
    drafter.propose = lambda rows, n, tok: {r: [never] * 3 for r in rows}
    tap = StatsTap(llm)
    got, _ = generate(llm, prompts[:1], [40])
    assert got[0] == expected[0][:40]
    drafts, draft_tokens, accepted = tap.totals()
    assert accepted == 0
    assert 4 <= drafts <= 8  # without the back-off: one draft per decode step, 39


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_other_architectures(arch, tmp_path):
    "Qwen3, and Gemma 3 (sliding-window layers: two KV cache groups; the draft model then runs without a cache)."
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    prompts, max_tokens = _prompts(1)
    ref, _ = generate(make_llm(path), prompts, max_tokens)
    for spec in (ngram(4), {"model": path, "num_speculative_tokens": 3}):
        llm = make_llm(path, speculative_config=spec)
        tap = StatsTap(llm)
        got, _ = generate(llm, prompts, max_tokens)
        assert got == ref, spec
        assert tap.totals()[0] > 0
        if "model" in spec:
            assert runner(llm).drafter.kv_mode is (arch != "gemma3")
            if arch == "qwen3":
                assert tap.totals()[2] == tap.totals()[1]  # its own draft: everything accepted
        assert_no_blocks_held(llm)
