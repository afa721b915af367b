"""Engine behaviour documented by vLLM, checked end to end on a tiny random-weight model: logprobs against
transformers, n > 1 with seeds, aborts returning every block, max_tokens=1, min_tokens, ignore_eos with a
generation config that has several EOS ids, and msgspec round trips of the engine-core structs."""
import json

import msgspec
import pytest
import torch
import transformers

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, LogprobsLists

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def test_logprobs_match_transformers(llm, ckpt):
    prompt = [5, 17, 42, 99, 7, 300, 12]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + comp.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    assert len(comp.logprobs) == 6
    total = 0.0
    for i, (tid, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert lp[tid].rank == 1                                        # greedy: the sampled token is the top one
        assert abs(lp[tid].logprob - row[tid].item()) < 1e-3
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(lp)
        for r, t in enumerate(top3, 1): assert lp[t].rank == r and abs(lp[t].logprob - row[t].item()) < 1e-3
        total += lp[tid].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-4
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(plp[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-3


def test_n_with_seed_is_diverse_and_reproducible(llm):
    sp = SamplingParams(n=4, seed=1234, temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [llm.generate("hello world", sp, use_tqdm=False)[0] for _ in range(2)]
    samples = [[tuple(c.token_ids) for c in sorted(r.outputs, key=lambda c: c.index)] for r in runs]
    assert len(samples[0]) == 4 and len(set(samples[0])) == 4            # four different completions
    assert samples[0] == samples[1]                                      # the same four on every run
    assert all(len(s) == 12 for s in samples[0])


def test_n_children_stream_to_the_end(llm):
    engine = llm.llm_engine
    engine.add_request("p", "hello", SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=5, ignore_eos=True,
                                                    output_kind=RequestOutputKind.DELTA))
    per_child: dict[int, list[int]] = {}
    finished = set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == "p"
            for c in o.outputs:
                per_child.setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason: finished.add(c.index)
    assert finished == {0, 1, 2} and all(len(t) == 5 for t in per_child.values())


def test_abort_many_streaming_requests_frees_every_block(llm):
    engine = llm.llm_engine
    kv = scheduler_of(llm).kv_cache_manager
    for i in range(100):
        engine.add_request(f"s{i}", [3 + i % 50, 7, 9, 11] * (1 + i % 5),
                           SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA, **GREEDY))
    for _ in range(3): engine.step()
    assert kv.usage > 0
    engine.abort_request([f"s{i}" for i in range(100)])
    assert not engine.has_unfinished_requests()
    assert scheduler_of(llm).get_num_unfinished_requests() == 0
    assert kv.usage == 0.0
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_gpu_blocks - 1   # all but the null block
    assert len(llm.generate("still works", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)) == 1


def test_max_tokens_one(llm):
    out = llm.generate(["a", "bb", "ccc"], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 1, 1]
    assert all(o.outputs[0].finish_reason == "length" for o in out)


def _greedy(llm, prompt, n=8, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, **kw), use_tqdm=False)[0].outputs[0]


def test_stop_token_ids_and_min_tokens(llm):
    base = _greedy(llm, "the cat", ignore_eos=True).token_ids
    stop_tok = base[1]
    first = base.index(stop_tok)
    out = _greedy(llm, "the cat", ignore_eos=True, stop_token_ids=[stop_tok])
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    held = _greedy(llm, "the cat", ignore_eos=True, stop_token_ids=[stop_tok], min_tokens=5)
    assert len(held.token_ids) >= 5 and stop_tok not in held.token_ids[:5]   # masked until min_tokens


def test_ignore_eos_with_several_generation_config_eos_ids(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "m")
    llm0 = LLM(path, dtype="float32", max_model_len=64)
    base = _greedy(llm0, "hello", n=8, ignore_eos=True).token_ids
    eos_a, eos_b = base[2], base[4]
    gen = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, eos_a, eos_b]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(path, dtype="float32", max_model_len=64)
    stopped = _greedy(llm, "hello")
    assert stopped.token_ids == base[:base.index(eos_a) + 1] and stopped.finish_reason == "stop"
    assert _greedy(llm, "hello", ignore_eos=True).token_ids == base                  # EOS ids never end it
    held = _greedy(llm, "hello", min_tokens=6)
    assert len(held.token_ids) >= 6 and not {2, eos_a, eos_b} & set(held.token_ids[:6])  # every EOS id held back


def test_engine_core_structs_round_trip(llm):
    req = llm.llm_engine.input_processor.process_inputs(
        "x", "hello", SamplingParams(max_tokens=5, min_tokens=2, stop=["ab"], stop_token_ids=[9], seed=3))
    enc = msgspec.msgpack.encode(req)
    back = msgspec.msgpack.decode(enc, type=EngineCoreRequest)
    assert back.prompt_token_ids == req.prompt_token_ids and back.request_id == "x"
    assert back.sampling_params.all_stop_token_ids == req.sampling_params.all_stop_token_ids
    assert back.sampling_params.stop_token_ids == req.sampling_params.stop_token_ids
    assert back.sampling_params.output_text_buffer_length == 1 and back.sampling_params.min_tokens == 2
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("x", [1, 2], new_logprobs=LogprobsLists([[1, 4]], [[-0.1, -2.0]], [1]),
                                                       finish_reason=FinishReason.STOP, stop_reason=9, num_cached_tokens=16)])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(outs), type=EngineCoreOutputs)
    o = back.outputs[0]
    assert (o.new_token_ids, o.finish_reason, o.stop_reason, o.num_cached_tokens) == ([1, 2], FinishReason.STOP, 9, 16)
    assert LogprobsLists(*o.new_logprobs).sampled_token_ranks == [1]


def test_priority_policy_with_preemption_keeps_outputs(ckpt):
    prompts = [{"prompt_token_ids": [10 + i] * (8 + 6 * i)} for i in range(6)]
    params = [SamplingParams(max_tokens=12, **GREEDY) for _ in prompts]
    base = [o.outputs[0].token_ids for o in LLM(ckpt, dtype="float32", max_model_len=128).generate(prompts, params, use_tqdm=False)]
    llm = LLM(ckpt, dtype="float32", max_model_len=128, scheduling_policy="priority", num_gpu_blocks_override=8,
              max_num_batched_tokens=32)
    got = llm.generate(prompts, params, use_tqdm=False, priority=[5, 0, 3, 1, 4, 2])
    assert [o.outputs[0].token_ids for o in got] == base
    assert scheduler_of(llm).num_preemptions > 0
    with pytest.raises(ValueError, match="priority"):   # priority needs the priority policy
        LLM(ckpt, dtype="float32", max_model_len=128).generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])


def test_abort_parent_request_aborts_every_child(llm):
    engine = llm.llm_engine
    engine.add_request("fan", "hello", SamplingParams(n=4, seed=1, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step(); engine.step()
    assert scheduler_of(llm).get_num_unfinished_requests() == 4
    engine.abort_request(["fan"])
    assert not engine.has_unfinished_requests()
    assert scheduler_of(llm).get_num_unfinished_requests() == 0
    assert scheduler_of(llm).kv_cache_manager.usage == 0.0
