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
