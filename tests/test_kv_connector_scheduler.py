"""The scheduler with a KV connector, under the signals a real transfer produces: asynchronous loads,
completions that arrive early, late, twice or never, aborts racing them, load errors, delayed frees.

A scripted connector (`ScriptedConnector`, reached through `kv_connector_module_path`) answers
`get_num_new_matched_tokens` from a per-request table and records every call. The model runner is a stub
(next token = last + 1) that returns whatever `KVConnectorOutput` the test hands it. After every step the
block pool's invariants hold (minivllm.v1.core.kv_cache_invariants).
"""
import json
import tempfile
from collections import defaultdict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from minivllm.v1.core.kv_cache_invariants import check_kv_cache_manager

from minivllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.kv_cache_utils import get_hash_fn_by_name, get_request_block_hasher, init_none_hash
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from minivllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from minivllm.v1.request import Request, RequestStatus

BS = 4
NUM_BLOCKS = 64
_hash = get_hash_fn_by_name("sha256")
init_none_hash(_hash)


class ScriptedMeta(KVConnectorMetadata):
    pass


class ScriptedConnector(KVConnectorBase_V1):
    """Scheduler side only. `matches[req_id] = (num_tokens | None, load_async)`; `delay[req_id]` makes
    `request_finished` keep the blocks; every call is appended to `calls`."""

    matches: dict = {}
    delay: set = set()
    calls: list = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, load_async = self.matches.get(request.request_id, (0, False))
        self.calls.append(("match", request.request_id, num_computed_tokens))
        if n is None:
            return None, False
        return max(0, n - num_computed_tokens), load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, len(blocks.get_block_ids()[0]), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return ScriptedMeta()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        delay = request.request_id in self.delay
        return delay, {"remote_block_ids": list(block_ids)} if delay else None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


@pytest.fixture(scope="module")
def model_dir():
    d = tempfile.mkdtemp()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f)
    return d


def make_scheduler(model_dir, budget=64) -> Scheduler:
    ScriptedConnector.matches, ScriptedConnector.delay, ScriptedConnector.calls = {}, set(), []
    kvt = KVTransferConfig(kv_connector="ScriptedConnector", kv_role="kv_both", kv_connector_module_path=__name__)
    vc = VllmConfig(ModelConfig(model_dir, max_model_len=256), cache_config=CacheConfig(block_size=BS),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256),
                    kv_transfer_config=kvt)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
    s = Scheduler(vc, KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec(["layer.0"], spec)]))
    assert isinstance(s.connector, ScriptedConnector)
    return s


def make_request(rid, n=10, max_tokens=3):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(1, n + 1)), sp, eos_token_id=999, block_hasher=get_request_block_hasher(BS, _hash))


def step(s: Scheduler, kv_out: KVConnectorOutput | None = None):
    "schedule + stub runner + update_from_output; returns (scheduler_output, outputs by request id)."
    so = s.schedule()
    assert isinstance(so.kv_connector_metadata, ScriptedMeta)
    ids = list(so.num_scheduled_tokens)
    sampled = [[(s.requests[r].all_token_ids[-1] + 1) % 1000]
               if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    mro = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, kv_connector_output=kv_out)
    eco = s.update_from_output(so, mro)
    check_kv_cache_manager(s.kv_cache_manager)
    outs = {o.request_id: o for e in eco.values() for o in e.outputs}
    return so, outs


def num_free(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_async_load_waits_then_runs_with_the_loaded_tokens(model_dir):
    s = make_scheduler(model_dir)
    ScriptedConnector.matches["r"] = (8, True)
    s.add_request(make_request("r"))
    so, _ = step(s)
    r = s.requests["r"]
    assert so.num_scheduled_tokens == {} and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ("alloc", "r", 2, 8) in ScriptedConnector.calls  # blocks reserved for the 8 external tokens
    assert num_free(s) == NUM_BLOCKS - 1 - 2
    step(s)  # nothing arrived yet: still waiting, never scheduled
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, KVConnectorOutput(finished_recving={"r"}))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"r": 2} and so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert len(s.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2  # the loaded blocks are cached


@pytest.mark.parametrize("order", ["never", "before_abort", "after_free", "twice"])
def test_abort_races_the_completion_signal(model_dir, order):
    s = make_scheduler(model_dir)
    ScriptedConnector.matches["r"] = (8, True)
    s.add_request(make_request("r"))
    step(s)
    if order == "before_abort":
        step(s, KVConnectorOutput(finished_recving={"r"}))
    if order == "twice":
        step(s, KVConnectorOutput(finished_recving={"r"}))
        step(s, KVConnectorOutput(finished_recving={"r"}))
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    step(s)
    if order in ("after_free", "twice"):
        step(s, KVConnectorOutput(finished_recving={"r", "never-seen"}, finished_sending={"r"}))
    assert num_free(s) == NUM_BLOCKS - 1 and "r" not in s.requests and not s.has_unfinished_requests()
    assert ("finished", "r") in ScriptedConnector.calls


def test_async_load_error_keeps_only_the_valid_prefix(model_dir):
    s = make_scheduler(model_dir)
    ScriptedConnector.matches["r"] = (8, True)
    s.add_request(make_request("r"))
    step(s)
    second_block = s.kv_cache_manager.get_block_ids("r")[0][1]
    step(s, KVConnectorOutput(invalid_block_ids={second_block}))
    step(s, KVConnectorOutput(finished_recving={"r"}))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"r": 6}  # block 0 (4 tokens) was valid, the rest is recomputed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4


def test_sync_load_error_drops_the_token_and_recomputes(model_dir):
    s = make_scheduler(model_dir)
    ScriptedConnector.matches["r"] = (8, False)
    s.add_request(make_request("r"))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r": 2}
    bad = s.kv_cache_manager.get_block_ids("r")[0][0]
    mro = ModelRunnerOutput(["r"], {"r": 0}, [[11]], kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}))
    eco = s.update_from_output(so, mro)
    check_kv_cache_manager(s.kv_cache_manager)
    assert not any(e.outputs for e in eco.values())  # the token computed over garbage is not emitted
    r = s.requests["r"]
    assert r.num_computed_tokens == 0 and r.num_output_tokens == 0
    assert s.kv_cache_manager.block_pool.blocks[bad].block_hash is None  # out of the prefix cache
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"r": 10}


def test_delayed_free_until_finished_sending(model_dir):
    s = make_scheduler(model_dir)
    ScriptedConnector.delay.add("p")
    s.add_request(make_request("p", max_tokens=1))
    _, outs = step(s)
    assert outs["p"].finish_reason is not None
    assert outs["p"].kv_transfer_params == {"remote_block_ids": s.kv_cache_manager.get_block_ids("p")[0]}
    held = NUM_BLOCKS - 1 - num_free(s)
    assert held == 3 and s.has_requests()  # kept for the send; the engine keeps stepping
    step(s, KVConnectorOutput(finished_sending={"someone-else"}))
    assert NUM_BLOCKS - 1 - num_free(s) == 3
    step(s, KVConnectorOutput(finished_sending={"p"}))
    assert num_free(s) == NUM_BLOCKS - 1 and not s.has_requests()


def test_undecided_connector_is_asked_again(model_dir):
    s = make_scheduler(model_dir)
    ScriptedConnector.matches["r"] = (None, False)
    s.add_request(make_request("r"))
    s.add_request(make_request("q"))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["q"] and s.requests["r"].status == RequestStatus.WAITING
    ScriptedConnector.matches["r"] = (0, False)
    so, _ = step(s)
    assert "r" in so.num_scheduled_tokens


class ConnectorSignals(RuleBasedStateMachine):
    """Random interleavings of admissions, steps, transfer completions, load errors, aborts and late or
    duplicate signals: the pool's invariants hold after every step, and once everything is aborted and
    every signal delivered, every block is free."""

    def __init__(self):
        super().__init__()
        self.model_dir = tempfile.mkdtemp()
        with open(f"{self.model_dir}/config.json", "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
                       "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "max_position_embeddings": 256}, f)
        self.s = make_scheduler(self.model_dir, budget=32)
        self.n = 0
        self.pending: dict[str, set] = defaultdict(set)  # signals to deliver at the next step

    @rule(ext=st.sampled_from([0, 4, 8, 12]), load_async=st.booleans(), delay=st.booleans(),
          n=st.integers(5, 20))
    def add(self, ext, load_async, delay, n):
        rid = f"r{self.n}"
        self.n += 1
        ScriptedConnector.matches[rid] = (min(ext, (n - 1) // BS * BS), load_async)
        if delay:
            ScriptedConnector.delay.add(rid)
        self.s.add_request(make_request(rid, n=n, max_tokens=3))

    @rule(data=st.data())
    def signal(self, data):
        kind = data.draw(st.sampled_from(["finished_recving", "finished_sending", "invalid_block_ids"]))
        if kind == "invalid_block_ids":
            self.pending[kind].add(data.draw(st.integers(1, NUM_BLOCKS - 1)))
        else:
            self.pending[kind].add(data.draw(st.sampled_from([f"r{i}" for i in range(self.n + 1)])))

    @rule()
    def run_step(self):
        out = KVConnectorOutput(finished_recving=self.pending.pop("finished_recving", None),
                                finished_sending=self.pending.pop("finished_sending", None),
                                invalid_block_ids=self.pending.pop("invalid_block_ids", set()))
        step(self.s, out)

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from([f"r{i}" for i in range(self.n)]))
        self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    @invariant()
    def pool_is_consistent(self):
        check_kv_cache_manager(self.s.kv_cache_manager)

    def teardown(self):
        self.s.finish_requests(list(self.s.requests), RequestStatus.FINISHED_ABORTED)
        everyone = {f"r{i}" for i in range(self.n)}
        step(self.s, KVConnectorOutput(finished_recving=everyone, finished_sending=everyone))
        assert num_free(self.s) == NUM_BLOCKS - 1, "blocks leaked"
        assert not self.s.requests and not self.s.has_requests()


TestConnectorSignals = ConnectorSignals.TestCase
TestConnectorSignals.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
