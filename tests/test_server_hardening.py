"""The OpenAI server against malformed, hostile and unusual requests (issue 12), through the real server.

Each bad request is followed by a normal one that must succeed. In-process servers over the tiny random
llama (as in test_server.py); the shutdown and clean-up checks run `minivllm serve` in a subprocess."""
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
try:   # the HTTP client the openai package is built on (httpx, renamed httpx2 in newer releases)
    import httpx
except ImportError:
    httpx = pytest.importorskip("httpx2")

from minivllm.entrypoints.openai.api_server import ServerThread, build_app_for_engine
from test_server import API_KEY, CHAT, Server, _gone, _launch_serve, _metrics, _real_engine, _serve_in_subprocess


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    srv = Server(_real_engine(tmp_path_factory))
    yield srv
    srv.stop()


def _error(server, path, body=None, raw=None, status=400):
    "POST a bad request; assert OpenAI's error shape and `status`; then a normal request must succeed."
    got, err = server.post(path, body, raw=raw)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["code"] == status
    ok = server.client.completions.create(model="tiny", prompt="fine", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    return err["error"]


# 1. a large n is refused with a 400 naming n (the limit in the message), never left hanging
@pytest.mark.parametrize("n", [2000, 4000, 0])
def test_n_out_of_range(real, n):
    err = _error(real, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "n": n})
    assert err["param"] == "n" and "[1, 128]" in err["message"]


# 2. oversized bodies are refused early; tokenization runs off the event loop
def test_huge_body_is_refused_while_health_answers(real):
    chunk = b"x" * 2 ** 20
    state = {}

    def body():
        yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
        for _ in range(50):
            time.sleep(0.02)   # a slow upload: /health is asked meanwhile
            yield chunk
        yield b'"}'

    def big():
        r = httpx.post(real.url + "/v1/completions", content=body(), timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        state["big"] = (r.status_code, r.json())
    t = threading.Thread(target=big)
    t.start()
    health = []
    while t.is_alive():
        r = httpx.get(real.url + "/health", timeout=5)
        health.append((r.status_code, t.is_alive()))
    t.join()
    assert (200, True) in health, health   # /health answered while the 50 MB request was in flight
    status, err = state["big"]
    assert status == 413 and err["error"]["code"] == 413 and "too large" in err["error"]["message"]
    assert real.client.completions.create(model="tiny", prompt="fine", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 10_000_000}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "x" * 10_000_000}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 10_000_000}]}, "messages")])
def test_prompt_that_cannot_fit_is_refused_before_tokenizing(real, path, body, param):
    err = _error(real, path, body)
    assert err["param"] == param and "maximum context length" in err["message"]


def test_tokenization_runs_off_the_event_loop(real):
    "A slow tokenizer holds its own request only: /health answers meanwhile."
    handler = real.app.state.openai_serving_completion
    tok = handler.tokenizer
    started = threading.Event()

    class SlowTokenizer:
        def __getattr__(self, name): return getattr(tok, name)
        def __len__(self): return len(tok)
        def encode(self, *a, **k):
            started.set()
            time.sleep(2)
            return tok.encode(*a, **k)
    handler.tokenizer = SlowTokenizer()
    result = {}
    try:
        t = threading.Thread(target=lambda: result.setdefault("r", real.client.completions.create(
            model="tiny", prompt="slow", max_tokens=2)))
        t.start()
        assert started.wait(30)
        assert httpx.get(real.url + "/health", timeout=5).status_code == 200
        assert t.is_alive()   # still tokenizing, yet /health answered
        t.join(60)
    finally:
        handler.tokenizer = tok
    assert result["r"].usage.completion_tokens >= 1


# 3. request chat templates need --trust-request-chat-template
LOOP = "{% for i in range(10**9) %}{% for j in range(10**9) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("extra", [{"chat_template": LOOP}, {"chat_template_kwargs": {"chat_template": LOOP}}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_request_chat_template_is_refused(real, extra, path):
    err = _error(real, path, {"model": "tiny", "messages": CHAT, **extra})
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_request_chat_template_with_trust(real):
    app = build_app_for_engine(real.llm, ["tiny"], trust_request_chat_template=True)
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/tokenize", json={"model": "tiny", "messages": CHAT, "chat_template": "{{ 'abc' }}"})
        assert r.status_code == 200, r.text
        text = httpx.post(srv.url + "/detokenize", json={"model": "tiny", "tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == "abc"   # the request's template was used
    app.state.engine_client.stat_loggers.remove(app.state.stat_logger)


# 4. features not built (and malformed structured outputs) are refused naming the field
@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"colour": "red"}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    # vLLM extensions minivllm lacks: the protocol keeps unknown fields, so these were 200s ignoring them
    ("/v1/completions", {"allowed_token_ids": [7]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"bad_words": ["the"]}, "bad_words"),
    ("/v1/completions", {"truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),  # a salt, when given, is a non-empty string
    ("/v1/completions", {"cache_salt": 5}, "cache_salt"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search")])
def test_unsupported_features(real, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **({"messages": CHAT} if "chat" in path else {"prompt": "Hi"}), **extra}
    assert _error(real, path, body)["param"] == param


def test_off_values_of_unsupported_extensions_are_fine(real):
    r = real.client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                       extra_body={"use_beam_search": False, "bad_words": [], "length_penalty": 1.0})
    assert r.usage.completion_tokens >= 1


def test_text_part_that_is_not_a_string_is_a_400(real):
    "A text part whose `text` is a number was a 500 (TypeError joining the parts); a bare string message too."
    for messages, words in [([{"role": "user", "content": [{"type": "text", "text": 5}]}],
                             "messages[0].content[0].text must be a string; got int"),
                            (["hello"], "messages.0: Input should be a valid dictionary")]:
        err = _error(real, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": messages})
        assert words in err["message"] and err["param"] == "messages", err


def test_response_format_text_and_tool_choice_none_are_fine(real):
    r = real.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=2,
                                            response_format={"type": "text"}, tool_choice="none")
    assert r.usage.completion_tokens >= 1


# 5. lone surrogates name their field; out-of-range integers are 400s; any 500 is OpenAI-shaped
SURROGATE = [("/v1/completions", {"prompt": "a\ud800"}, "prompt"),
             ("/v1/completions", {"prompt": "a", "model": "tiny\ud800"}, "model"),
             ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, "stop"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
             ("/v1/chat/completions", {"messages": CHAT, "stop": ["\ud800"]}, "stop"),
             ("/tokenize", {"prompt": "\ud800"}, "prompt"),
             ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages")]


@pytest.mark.parametrize("path,body,param", SURROGATE)
def test_lone_surrogate(real, path, body, param):
    raw = json.dumps({"model": "tiny", **body}).encode()   # json.dumps escapes it as \ud800: valid JSON
    assert _error(real, path, raw=raw)["param"] == param


@pytest.mark.parametrize("field,value", [("top_k", 2 ** 70), ("stop_token_ids", [2 ** 70]), ("seed", 2 ** 70),
                                         ("priority", 2 ** 70), ("max_tokens", 2 ** 70)])
def test_integers_out_of_range(real, field, value):
    assert _error(real, "/v1/completions", {"model": "tiny", "prompt": "Hi", field: value})["param"] == field


def test_unexpected_exception_is_an_openai_500(real):
    models = real.app.state.openai_serving_models
    async def broken(): raise RuntimeError("boom \ud800")
    models.show_available_models = broken
    try:
        r = httpx.get(real.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    finally:
        del models.show_available_models
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError" and "boom" in err["message"]
    assert [m.id for m in real.client.models.list().data] == ["tiny"]


# 6. bodies that do not parse, unknown routes and wrong methods: OpenAI's shape, not FastAPI's {"detail"}
@pytest.mark.parametrize("raw,words", [
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "UnicodeDecodeError"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
    (b"[" * 100_000 + b"]" * 100_000, "RecursionError")])
def test_unparseable_bodies(real, raw, words):
    err = _error(real, "/v1/completions", raw=raw)
    assert words in err["message"] and err["type"] == "BadRequestError"


def test_unknown_route_and_wrong_method(real):
    r = httpx.get(real.url + "/v1/nowhere", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "detail" not in r.json()
    r = httpx.get(real.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"
    assert "POST" in r.headers.get("allow", "")
    r = httpx.put(real.url + "/tokenize", json={"prompt": "x"})
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


# 7. the error's param is the field at fault
@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": "not a list"}, "messages"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": "x"}, "chat_template_kwargs")])
def test_error_param(real, path, body, param):
    err = _error(real, path, {"model": "tiny", **body})
    assert err["param"] == param and "TokenizeCompletionRequest" not in err["message"]


# 12. OpenAI-API bug classes
def test_continuous_usage_stats(real):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(real.client.completions.create(model="tiny", prompt="Count", max_tokens=4, stream=True,
                                                 stream_options=opts, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    running = [c.usage.completion_tokens for c in chunks if c.choices]
    assert running == sorted(running) and running[-1] == 4 == chunks[-1].usage.completion_tokens
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    chat = list(real.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3, stream=True,
                                                    stream_options=opts, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 3
    plain = list(real.client.completions.create(model="tiny", prompt="Count", max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 2


def test_echo_max_tokens_0_scores_the_prompt(real):
    prompt = "The quick brown fox"
    r = real.client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    n = real.count_tokens(prompt=prompt)
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n and lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == prompt


def test_aborted_requests_are_counted(real):
    real.wait_idle()
    key = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "tiny")))
    before = _metrics(real).get(key, 0.0)
    stream = real.client.completions.create(model="tiny", prompt="Go on", max_tokens=200, stream=True,
                                            extra_body={"ignore_eos": True})
    assert len([c for _, c in zip(range(2), stream)]) == 2
    stream.close()
    real.wait_idle()
    deadline = time.monotonic() + 30
    while _metrics(real).get(key, 0.0) == before:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.05)
    assert _metrics(real)[key] == before + 1


def test_text_parts_are_joined_with_newlines(real):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]}]
    assert real.count_tokens(messages=parts) == real.count_tokens(messages=[{"role": "user", "content": "Hello\nWorld"}])
    assert real.count_tokens(messages=parts) != real.count_tokens(messages=[{"role": "user", "content": "HelloWorld"}])


def test_logprob_bytes_are_the_tokens_raw_bytes(real):
    tok = real.app.state.openai_serving_chat.tokenizer
    first, second = tok.encode("é", add_special_tokens=False)   # one token per UTF-8 byte in the tiny vocabulary
    r = real.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=2, temperature=0,
                                            logprobs=True, top_logprobs=1, logit_bias={str(first): 100},
                                            extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [t.bytes for t in content] == [[0xC3], [0xC3]]
    top = content[0].top_logprobs[0]   # the raw model's favourite (logprobs are taken before logit_bias)
    assert top.token == "\ufffd" or bytes(top.bytes).decode() == top.token
    r = real.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=1, temperature=0,
                                            logprobs=True, logit_bias={str(second): 100})
    assert r.choices[0].logprobs.content[0].bytes == [0xA9]


# 8. clean-up and bounded shutdown of `minivllm serve`
def _tmp_files(tmpdir) -> list[str]: return [p.name for p in tmpdir.iterdir() if p.name.startswith("minivllm-")]


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid) and time.monotonic() < deadline: time.sleep(0.1)
    return _gone(pid)


def test_sigkilled_server_leaves_no_ipc_files(tmp_path):
    proc, port, tmpdir, engine_pid = _serve_in_subprocess(tmp_path)
    assert len(_tmp_files(tmpdir)) == 2
    proc.kill()
    proc.wait(30)
    assert _wait_gone(engine_pid)
    assert _tmp_files(tmpdir) == []


def test_keep_alive_then_sigterm_leaves_no_ipc_files(tmp_path):
    proc, port, tmpdir, engine_pid = _serve_in_subprocess(tmp_path, {"MINIVLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    try:
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None: proc.kill()
    assert _tmp_files(tmpdir) == []


def _long_stream(port: int, got: dict) -> None:
    "Stream up to 4000 tokens; record how many chunks arrived and whether [DONE] came."
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    got["chunks"], got["done"] = 0, False
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]": got["done"] = True
                elif line.startswith("data: "): got["chunks"] += 1
    except httpx.HTTPError as e:
        got["error"] = repr(e)


@pytest.mark.parametrize("second_signal", [False, pytest.param(True, marks=pytest.mark.slow)])  # 14 s each
def test_sigterm_drain_is_bounded(tmp_path, second_signal):
    """With --shutdown-timeout 1 a 4000-token stream is cut about a second after SIGTERM; with a long timeout
    a second SIGTERM cuts it at once. Either way the server exits cleanly and removes its IPC files."""
    from minivllm.testing import make_tiny_checkpoint
    make_tiny_checkpoint("llama", tmp_path / "tiny", max_position_embeddings=8192)
    timeout = "600" if second_signal else "1"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, port = _launch_serve(tmp_path, ["--max-model-len", "4096", "--shutdown-timeout", timeout],
                               {"TMPDIR": str(tmpdir), "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1"}, reuse_checkpoint=True)
    got = {}
    t = threading.Thread(target=_long_stream, args=(port, got))
    try:
        t.start()
        deadline = time.monotonic() + 60
        while got.get("chunks", 0) < 5:
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(1)
            assert proc.poll() is None   # still draining: the long timeout holds it
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None: proc.kill()
        t.join(60)
    assert not got["done"] and got["chunks"] < 4000, got   # the stream was cut, not waited for
    assert _tmp_files(tmpdir) == []


def _group_members(pgid: int) -> list[int]:
    "Pids of the live (not zombie) processes of process group `pgid`, from /proc."
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f: fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if d.isdigit() and int(fields[2]) == pgid and fields[0] not in ("Z", "X"): pids.append(int(d))
    return pids


def test_group_sigterm_drains_like_ctrl_c(tmp_path):
    """SIGTERM to the server's whole process group (systemd's default KillMode=control-group, `kill -TERM
    -<pgid>`) reaches the engine core too. It used to exit at once, cutting the open stream with an
    EngineDeadError event; now it waits while the front end drains: the stream ends with [DONE] and no error,
    the server exits 0, its IPC files are gone and no process of its group is left."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    from minivllm.testing import make_tiny_checkpoint
    make_tiny_checkpoint("llama", tmp_path / "tiny", max_position_embeddings=8192)
    # long enough to be streaming when SIGTERM comes: the output handler merges the deltas a slow reader has
    # not taken, so under load 300 tokens once came in 2 chunks and the stream was over before the signal
    proc, port = _launch_serve(tmp_path, ["--max-model-len", "4096", "--block-size", "16", "--shutdown-timeout", "300"],
                               {"TMPDIR": str(tmpdir), "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1"}, new_session=True,
                               reuse_checkpoint=True)
    got = {"chunks": 0, "done": False, "errors": []}

    def stream():
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]": got["done"] = True
                    elif line.startswith("data: "):
                        got["chunks"] += 1
                        chunk = json.loads(line[6:])
                        if "error" in chunk: got["errors"].append(line)
                        else: got["finish"] = chunk["choices"][0]["finish_reason"] or got.get("finish")
        except httpx.HTTPError as e:
            got["errors"].append(repr(e))

    t = threading.Thread(target=stream)
    try:
        pgid = os.getpgid(proc.pid)
        assert pgid == proc.pid and pgid != os.getpgrp()   # never signal the group pytest runs in
        members = _group_members(pgid)
        assert len(members) >= 2, members                  # the server and its engine core
        t.start()
        deadline = time.monotonic() + 60
        while got["chunks"] < 1:
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.05)
        assert not got["done"], got  # still streaming: the drain has something to wait for
        os.killpg(pgid, signal.SIGTERM)
        assert proc.wait(120) == 0
        t.join(60)
        deadline = time.monotonic() + 30
        while _group_members(pgid) and time.monotonic() < deadline: time.sleep(0.2)
        assert _group_members(pgid) == []
    finally:
        if proc.poll() is None: proc.kill()
        try: os.killpg(proc.pid, signal.SIGKILL)   # never leave the engine behind, even when the test fails
        except ProcessLookupError: pass
        t.join(60)
    assert got["done"] and got["errors"] == [] and got["finish"] == "length", got   # all 3000 tokens
    assert _tmp_files(tmpdir) == []


def test_a_request_cut_by_the_drain_gets_an_openai_503(tmp_path):
    """A non-streamed request still running when --shutdown-timeout (1 s) runs out is answered 503 in OpenAI's
    error shape (uvicorn answered the cancelled request with a plain-text 500 no OpenAI client can read)."""
    from minivllm.testing import make_tiny_checkpoint
    make_tiny_checkpoint("llama", tmp_path / "tiny", max_position_embeddings=8192)
    proc, port = _launch_serve(tmp_path, ["--max-model-len", "4096", "--shutdown-timeout", "1"],
                               {"MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1"}, reuse_checkpoint=True)
    got = {}

    def long_request():
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 4000, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        got["status"], got["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request)
    try:
        t.start()
        deadline = time.monotonic() + 60
        running = ""
        while not running.endswith(" 1.0"):  # the request is in the engine
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.1)
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            running = next((ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")), "")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None: proc.kill()
        t.join(60)
    assert got["status"] == 503, got
    assert got["body"]["error"]["code"] == 503 and "shutting down" in got["body"]["error"]["message"]


@pytest.mark.parametrize("body,param", [({"logit_bias": {str(2 ** 70): 1}}, "logit_bias"),
                                        ({"stop_token_ids": [2 ** 63]}, "stop_token_ids"),
                                        ({"top_k": 2 ** 63}, "top_k")])
def test_sampling_params_refusals_are_400s(real, body, param):
    "Values only SamplingParams can judge (its ValueErrors) reach the client as 400s naming the field."
    assert _error(real, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, **body})["param"] == param


def _listening_inode(port: int) -> str:
    "The socket inode of the TCP socket listening on `port` (127.0.0.1 or any address), from /proc/net/tcp*."
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    return fields[9]
    raise AssertionError(f"nothing listens on {port}")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def test_the_engine_process_does_not_hold_the_servers_listening_socket(tmp_path):
    """`serve` binds its port before the engine core is forked, and a fork keeps every open file: the engine
    held the listening socket too, so after a `kill -9` of the API server clients were accepted and reset and
    the port stayed taken until the engine exited. The socket is closed in forked children."""
    proc, port = _launch_serve(tmp_path, ["--max-model-len", "128"], {"MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1"},
                               new_session=True)
    try:
        inode = _listening_inode(port)
        assert inode in _socket_inodes(proc.pid)
        children = [p for p in _group_members(proc.pid) if p != proc.pid]
        assert children, "no engine process"
        for child in children:
            assert inode not in _socket_inodes(child), f"process {child} holds the listening socket"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None: proc.kill()
        try: os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError: pass
