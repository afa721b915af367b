"""Where minivllm's public surface and OpenAI-compatible server must behave as vLLM's do.

Package surface (`from minivllm import LLM, SamplingParams`, lazily), and server details a client can
see: request fields that must take effect (`logit_bias`, `prompt_logprobs`), `echo` with logprobs and
`continue_final_message`, one choice per streamed chunk, the `param` of errors, and the `/metrics`
series vLLM exports. The server runs in-process over the tiny random-weight llama (and, where the
shape is all that matters, over the fake engine), as in test_server.py."""
import json
import subprocess
import sys
import urllib.request

import pytest

from test_server import API_KEY, CHAT, Server, _fake_engine, _real_engine


def test_top_level_names_are_lazy_and_the_same_objects():
    code = """
import sys
import minivllm
assert 'torch' not in sys.modules, 'import minivllm pulled in torch'
from minivllm import LLM, SamplingParams, RequestOutput, CompletionOutput, EngineArgs, LLMEngine, AsyncLLM, AsyncLLMEngine
from minivllm.entrypoints.llm import LLM as L2
from minivllm.sampling_params import SamplingParams as S2
from minivllm.outputs import RequestOutput as R2, CompletionOutput as C2
from minivllm.engine.arg_utils import EngineArgs as E2
from minivllm.v1.engine.llm_engine import LLMEngine as LE2
from minivllm.v1.engine.async_llm import AsyncLLM as A2
assert (LLM, SamplingParams, RequestOutput, CompletionOutput, EngineArgs, LLMEngine, AsyncLLM, AsyncLLMEngine) == (L2, S2, R2, C2, E2, LE2, A2, A2)
assert 'LLM' in dir(minivllm) and minivllm.__version__
try:
    minivllm.NoSuchThing
except AttributeError as e:
    assert 'NoSuchThing' in str(e)
else:
    raise AssertionError('unknown attribute did not raise')
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    srv = Server(_real_engine(tmp_path_factory))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    srv = Server(_fake_engine(tmp_path_factory))
    yield srv
    srv.stop()


def _sse(server, path, body) -> list[dict]:
    "POST a streaming request; the parsed JSON chunks (without the final [DONE])."
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r: text = r.read().decode()
    events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "Hi there"})])
def test_stream_n2_one_choice_per_chunk(fake, path, body):
    chunks = _sse(fake, path, {"model": "tiny", "n": 2, "max_tokens": 3, "stream": True, **body})
    assert all(len(c["choices"]) == 1 for c in chunks), [c["choices"] for c in chunks]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    if "messages" in body:   # each choice opens with its own role delta
        roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
        assert sorted(roles) == [0, 1]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": CHAT})])
def test_bad_priority_names_priority(real, path, body):
    status, err = real.post(path, {"model": "tiny", "max_tokens": 2, "priority": 5, **body})
    assert status == 400 and err["error"]["param"] == "priority", err


def test_completion_echo_logprobs_cover_the_prompt(real):
    prompt = "The quick brown fox"
    n_prompt = real.count_tokens(prompt=prompt)
    status, r = real.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                              "logprobs": 1, "echo": True})
    assert status == 200, r
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == n_prompt + r["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None      # nothing precedes the first token
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the prompt part agrees with prompt_logprobs, which echo+logprobs also returns (vLLM's shape)
    plp = choice["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    ids = real.post("/tokenize", {"model": "tiny", "prompt": prompt})[1]["tokens"]
    for k in range(1, n_prompt):
        entry = plp[k][str(ids[k])]
        assert abs(entry["logprob"] - lp["token_logprobs"][k]) < 1e-6 and set(entry) == {"logprob", "rank", "decoded_token"}
    # streamed: the same tokens and offsets, spread over the chunks
    chunks = _sse_body(real, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                 "logprobs": 1, "echo": True, "stream": True})
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks), []) == lp["tokens"]
    assert sum((c["choices"][0]["logprobs"]["text_offset"] for c in chunks), []) == lp["text_offset"]


def _sse_body(server, path, body):
    return [c for c in _sse(server, path, body) if c.get("choices")]


def test_prompt_logprobs_extra_field(real):
    status, r = real.post("/v1/completions", {"model": "tiny", "prompt": "one two three", "max_tokens": 1, "prompt_logprobs": 2})
    assert status == 200, r
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(1 <= len(step) <= 3 for step in plp[1:])            # the prompt token + the top 2
    status, c = real.post("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200, c
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    # without it, nothing is computed or returned
    assert real.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})[1]["choices"][0]["prompt_logprobs"] is None
    # n = 2: one copy of the prompt's logprobs (each sample's request scores the prompt), not two
    status, r2 = real.post("/v1/completions", {"model": "tiny", "prompt": "one two three", "max_tokens": 1, "n": 2,
                                               "temperature": 0, "prompt_logprobs": 2})
    assert status == 200, r2
    assert [len(ch["prompt_logprobs"]) for ch in r2["choices"]] == [r2["usage"]["prompt_tokens"]] * 2


@pytest.mark.parametrize("path,body,words", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 100000}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "stream")])
def test_prompt_logprobs_refused(real, path, body, words):
    status, err = real.post(path, {"model": "tiny", "max_tokens": 1, **body})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs" and words in err["error"]["message"], err


def test_chat_echo_continue_final_message(real):
    partial = "Sure, the count is"
    msgs = CHAT + [{"role": "assistant", "content": partial}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0, "continue_final_message": True,
            "add_generation_prompt": False}
    plain = real.post("/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    echoed = real.post("/v1/chat/completions", {**body, "echo": True})[1]["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": partial + plain}
    streamed = _sse_body(real, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == partial + plain


def _ids_of(server, text: str) -> list[int]:
    "Every token id whose text is `text` (a greedy pick may have twins in a random-weight tiny vocabulary)."
    tok = server.llm.get_tokenizer()
    return [i for i in range(len(tok)) if tok.decode([i]) == text]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "The capital of France is"}),
    ("/v1/chat/completions", {"messages": CHAT})])
def test_logit_bias_bans_and_forces_tokens(real, path, body):
    def first_token(**extra):
        status, r = real.post(path, {"model": "tiny", "max_tokens": 1, "temperature": 0, **body, **extra})
        assert status == 200, r
        c = r["choices"][0]
        return c["text"] if "text" in c else c["message"]["content"]
    greedy = first_token()
    banned = _ids_of(real, greedy)
    assert banned, greedy
    assert first_token(logit_bias={str(i): -100 for i in banned}) != greedy
    tok = real.llm.get_tokenizer()
    forced = next(i for i in range(len(tok) - 1, 0, -1) if tok.decode([i]).strip() and i not in banned)
    assert first_token(logit_bias={str(forced): 100}) == tok.decode([forced])


@pytest.mark.parametrize("bias,words", [({"5": 101}, "[-100, 100]"), ({"abc": 1}, "int"), ({"99999999": 1}, "logit_bias")])
def test_logit_bias_refused(real, bias, words):
    status, err = real.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, "logit_bias": bias})
    assert status == 400 and err["error"]["param"] == "logit_bias" and words in err["error"]["message"], err


def test_metrics_series_match_vllm(real):
    from prometheus_client.parser import text_string_to_metric_families
    def scrape():
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(real.get("/metrics")) for s in fam.samples}
    real.wait_idle()
    before = scrape()
    r = real.client.completions.create(model="tiny", prompt="Counting metric series", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    real.wait_idle()
    after = scrape()
    m = (("model_name", "tiny"),)
    def delta(name): return after.get((name, m), 0.0) - before.get((name, m), 0.0)
    names = {n for n, _ in after}
    assert not [n for n in names if n.endswith("_created")]                       # vLLM disables them
    assert "vllm:prefix_cache_hit_rate" not in names and "vllm:time_per_output_token_seconds_count" not in names
    assert delta("vllm:request_prompt_tokens_sum") == r.usage.prompt_tokens and delta("vllm:request_prompt_tokens_count") == 1
    assert delta("vllm:request_generation_tokens_sum") == 4 and delta("vllm:request_generation_tokens_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") >= 1                  # token batches after the first
    assert delta("vllm:request_decode_time_seconds_count") == 1
    me = (("engine", "0"), ("model_name", "tiny"))  # fed from SchedulerStats: one series per engine
    assert after.get(("vllm:prefix_cache_queries_total", me), 0.0) - before.get(("vllm:prefix_cache_queries_total", me), 0.0) == r.usage.prompt_tokens
    assert after[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "tiny")))] >= 1


def test_metrics_request_phase_histograms(real):
    "vLLM's per-request queue / prefill / inference (and decode) histograms: one observation per finished request."
    from prometheus_client.parser import text_string_to_metric_families
    def scrape():
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(real.get("/metrics")) for s in fam.samples}
    real.wait_idle()
    before = scrape()
    n = 3
    for i in range(n):
        real.client.completions.create(model="tiny", prompt=f"Phase times {i}", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    real.wait_idle()
    after = scrape()
    m = (("model_name", "tiny"),)
    def delta(name): return after.get((name, m), 0.0) - before.get((name, m), 0.0)
    for phase in ("queue", "prefill", "inference", "decode"):
        assert (f"vllm:request_{phase}_time_seconds_count", m) in after, phase
        assert delta(f"vllm:request_{phase}_time_seconds_count") == n, phase
        assert (f"vllm:request_{phase}_time_seconds_bucket", (("le", "7680.0"),) + m) in after, phase  # vLLM's buckets
    assert delta("vllm:e2e_request_latency_seconds_count") == n
    assert 0.0 <= delta("vllm:request_queue_time_seconds_sum") <= delta("vllm:e2e_request_latency_seconds_sum")
    # > 0 only from the engine core's QUEUED / SCHEDULED stamps (without events the queue time is taken as 0)
    assert delta("vllm:request_queue_time_seconds_sum") > 0.0 and delta("vllm:request_prefill_time_seconds_sum") > 0.0
    assert abs(delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum")
               - delta("vllm:request_inference_time_seconds_sum")) < 1e-6
