"""A tenth try-to-break pass on the KV connectors (issue 30), part d: a P/D consumer with a small KV cache.

1. Head-of-line livelock. A P2pZmqConnector consumer (`num_gpu_blocks_override=9`, 8 prompts of 40-61
   tokens, `max_tokens=40`) sometimes never returned: nothing running, 4 blocks free, the waiting queue a
   PREEMPTED request holding nothing at the front and behind it a request whose pull had arrived
   (WAITING_FOR_REMOTE_KVS, 4 blocks, already in `finished_recving_kv_req_ids`). `_schedule_waiting` stopped
   at the front request, which did not fit beside those 4 blocks, so the request holding them was never
   looked at: it never ran and never freed (91,277 empty steps in 15 s). Now, when nothing runs, requests
   holding blocks may pass a head that does not fit (chapter 23, "Phase 2"); requests holding nothing keep
   their place behind it, unless loads are in flight (rule 5, pass 19: then any request that fits may pass).
2. Holders that cannot grow. Two requests whose asynchronous loads filled the pool, each needing one more
   block for its last prompt token, waited for each other forever; now the first gives its blocks back
   (`_release_waiting_blocks`, recompute) and the second runs.
3. Requests set aside in one step (KV still arriving, grammar compiling, LoRA slots) came back in reverse
   order (`skipped.prepend_request`, then `prepend_requests`); they now keep their order.

Scheduler-level cases use the scripted connector and stub runner of tests/test_kv_connector_scheduler.py;
the engine-level case holds back the consumer's report of one pull until the other request has preempted
itself (a slow transfer), which made the livelock certain instead of 1 run in 5.
"""

import json
import time

import pytest
import torch
from test_kv_connector_pd import _prefill, free_port
from test_kv_connector_scheduler import BS, ScriptedConnector, _hash, step

from minivllm import LLM, SamplingParams
from minivllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from minivllm.sampling_params import SamplingParams as SP
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.core.kv_cache_utils import get_request_block_hasher
from minivllm.v1.core.sched.async_scheduler import AsyncScheduler
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from minivllm.v1.outputs import KVConnectorOutput
from minivllm.v1.request import Request, RequestStatus

MAX_STEPS = 300  # each case finishes in well under 100 steps; the livelock schedules nothing forever


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def make_request(rid, n, max_tokens, start=None):
    "An n-token prompt of its own (no shared prefix: a prefix-cache hit would replace the scripted load)."
    start = 1 + 50 * (sum(map(ord, rid)) % 19) if start is None else start
    sp = SP(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start, start + n)), sp, eos_token_id=999,
                   block_hasher=get_request_block_hasher(BS, _hash))


def _expected(r, n):
    return [(r.prompt_token_ids[-1] + k) % 1000 for k in range(1, n + 1)]


def _scheduler(model_dir, cls=Scheduler, policy="fcfs", num_blocks=9) -> Scheduler:
    "The scripted-connector scheduler of test_kv_connector_scheduler with a small pool (8 usable blocks)."
    ScriptedConnector.matches, ScriptedConnector.delay, ScriptedConnector.calls = {}, set(), []
    kvt = KVTransferConfig(kv_connector="ScriptedConnector", kv_role="kv_both",
                           kv_connector_module_path="test_kv_connector_scheduler")
    sc = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, policy=policy)
    vc = VllmConfig(ModelConfig(model_dir, max_model_len=256), cache_config=CacheConfig(block_size=BS),
                    scheduler_config=sc, kv_transfer_config=kvt)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
    return cls(vc, KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer.0"], spec)]))


def _loading(s: Scheduler) -> set[str]:
    return {r.request_id for r in s.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}


def _collect(outs: dict, tokens: dict) -> None:
    for rid, o in outs.items():
        tokens.setdefault(rid, []).extend(o.new_token_ids)


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_holder_behind_a_head_that_does_not_fit_runs(model_dir, cls, policy):
    """r0 runs, r1's 12 loaded tokens hold 3 blocks; r0 grows until it preempts itself (21 tokens, 6 blocks;
    5 free) and only then does r1's load finish. Before: nothing was scheduled again, ever."""
    s = _scheduler(model_dir, cls, policy)
    ScriptedConnector.matches["r1"] = (12, True)
    r0, r1 = make_request("r0", 12, max_tokens=20), make_request("r1", 15, max_tokens=8)
    s.add_request(r0)
    s.add_request(r1)
    tokens, steps, stalled_at = {}, [], None
    for n in range(MAX_STEPS):
        if not s.has_unfinished_requests():
            break
        kv_out = None
        if stalled_at is None and r0.status == RequestStatus.PREEMPTED:  # the slow transfer lands now
            stalled_at = n
            kv_out = KVConnectorOutput(finished_recving={"r1"})
            r2 = make_request("r2", 3, max_tokens=2)
            s.add_request(r2)  # arrives during the stall, holds nothing
            print("stalled queue:", [(r.request_id, r.status.name, r.num_computed_tokens) for r in s.waiting])
        so, outs = step(s, kv_out)
        steps.append(set(so.num_scheduled_tokens))
        _collect(outs, tokens)
    assert not s.has_unfinished_requests(), f"livelock: {[(r.request_id, r.status.name) for r in s.waiting]}"
    assert stalled_at is not None and r0.num_preemptions == 1
    assert tokens == {"r0": _expected(r0, 20), "r1": _expected(r1, 8), "r2": _expected(r2, 2)}
    after = steps[stalled_at:]
    first = {rid: min(n for n, ids in enumerate(after) if rid in ids) for rid in ("r0", "r1", "r2")}
    assert first["r1"] < first["r0"]  # r1 passed r0
    # r2 fits beside r1's load while that is in flight (chapter 23, "Phase 2" rule 5): it need not wait for r0
    assert first["r2"] < first["r0"]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 8


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_holders_that_fill_the_pool_and_cannot_grow_make_room(model_dir, cls):
    """a and b load 16 tokens each (4 full blocks: the whole pool); each needs a fifth block for its 17th
    prompt token. Before: neither was ever scheduled. Now a gives its blocks back and b runs; c, holding
    nothing, does not pass a then (a's second load, later, is set aside like any load in flight)."""
    s = _scheduler(model_dir, cls)
    reqs = [make_request("a", 17, 4), make_request("b", 17, 4), make_request("c", 3, 2)]
    for r in reqs:
        ScriptedConnector.matches[r.request_id] = (16, True) if r.request_id != "c" else (0, False)
        s.add_request(r)
    tokens, first = {}, {}
    for n in range(MAX_STEPS):
        if not s.has_unfinished_requests():
            break
        so, outs = step(s, KVConnectorOutput(finished_recving=_loading(s)))  # every load lands in one step
        for rid in so.num_scheduled_tokens:
            first.setdefault(rid, n)
        _collect(outs, tokens)
    assert not s.has_unfinished_requests(), f"livelock: {[(r.request_id, r.status.name) for r in s.waiting]}"
    assert tokens == {r.request_id: _expected(r, r.max_tokens) for r in reqs}
    assert first["b"] < min(first["a"], first["c"])  # c did not pass a in the step b passed it

    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 8


def test_requests_set_aside_keep_their_order(model_dir):
    "Three loads in flight are set aside every step; the queue keeps their arrival order."
    s = _scheduler(model_dir, num_blocks=64)
    for rid in ("x", "y", "z"):
        ScriptedConnector.matches[rid] = (8, True)
        s.add_request(make_request(rid, 10, 3))
    for _ in range(3):
        step(s)
        assert [r.request_id for r in s.waiting] == ["x", "y", "z"]


# ---- the P/D consumer itself ----

A, B = list(range(5, 5 + 40)), list(range(300, 300 + 61))  # 3 and 4 blocks of 16 when pulled
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _llm(ckpt, kvt=None, blocks=None):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, kv_transfer_config=kvt,
               num_gpu_blocks_override=blocks)


def test_p2p_consumer_with_9_blocks_finishes_with_one_instances_tokens(ckpt, monkeypatch):
    """A (40 tokens) and B (61) pulled by a consumer with 8 usable blocks: B's 4 blocks are reserved for its
    pull, A decodes until it needs a fifth block and preempts itself (65 tokens: 5 blocks, 4 free); B's pull
    is reported only then. Before: nothing was ever scheduled again. Now B runs, then A, with the tokens of
    one instance."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = _llm(ckpt)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(
            [{"prompt_token_ids": p} for p in (A, B)], greedy, use_tqdm=False)]
    finally:
        ref.llm_engine.shutdown()
    port = free_port()
    prod = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": port})
    cons = _llm(ckpt, {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 20}}, blocks=9)
    try:
        sched = cons.llm_engine.engine_core.engine_core.scheduler
        held, gate = set(), {"open": False, "steps_after": 0}  # steps after the stall began
        update = sched._update_from_kv_xfer_finished

        def slow_pull_of_b(kv_out):  # B's finished pull is held back here...
            update(kv_out)
            for rid in list(sched.finished_recving_kv_req_ids):
                if not gate["open"] and sched.requests[rid].num_prompt_tokens == len(B):
                    sched.finished_recving_kv_req_ids.discard(rid)
                    held.add(rid)

        def stalled() -> bool:  # ...until A has preempted itself and nothing runs
            if not gate["open"] and not sched.running:
                gate["open"] = any(r.status == RequestStatus.PREEMPTED for r in sched.waiting)
            if gate["open"]:
                sched.finished_recving_kv_req_ids |= held
                held.clear()
            return gate["open"]

        sched._update_from_kv_xfer_finished = slow_pull_of_b
        params = [_prefill(prod, p).kv_transfer_params for p in (A, B)]
        for name, p, kvp in zip("AB", (A, B), params):
            sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                extra_args={"kv_transfer_params": kvp})
            cons.llm_engine.add_request(name, {"prompt_token_ids": p}, sp)
        finished, t0 = {}, time.monotonic()
        while len(finished) < 2:
            assert time.monotonic() - t0 < 120, (  # a guard against a hang; the step count below is the check
                f"not finished within 120 s: {gate} held {held} "
                f"running {[(r.request_id, r.num_computed_tokens) for r in sched.running]} "
                f"waiting {[(r.request_id, r.status.name, r.num_computed_tokens) for r in sched.waiting]} "
                f"free {sched.kv_cache_manager.block_pool.get_num_free_blocks()} finished {list(finished)}"
            )
            gate["steps_after"] += stalled()
            finished.update({o.request_id: o for o in cons.llm_engine.step() if o.finished})
            assert gate["steps_after"] < 5000, (
                f"livelock: {[(r.request_id, r.status.name, r.num_computed_tokens) for r in sched.waiting]}"
            )
        assert gate["open"]  # the stall really happened: A preempted, nothing running, B's pull arrived
        got = [finished[n].outputs[0].token_ids for n in "AB"]
        assert [list(g) for g in got] == [list(w) for w in want]
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 8
    finally:
        prod.llm_engine.shutdown()
        cons.llm_engine.shutdown()
