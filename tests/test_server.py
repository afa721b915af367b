"""The OpenAI-compatible server end to end, driven by the official `openai` client.

The server runs in-process on 127.0.0.1 (a free port) over two engine cores: the real one with a tiny
random-weight llama checkpoint (in this process), and the model-free `FakeEngineCoreClient` (chapter 50),
which keeps the HTTP layer covered even where the engine changes. Every test is a few requests of a few tokens."""
import json
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from minivllm.entrypoints.openai.api_server import ServerThread, build_app_for_engine
from minivllm.v1.engine.async_llm import AsyncLLM

API_KEY = "sk-minivllm-test"


def _real_engine(tmp_path_factory):
    "`AsyncLLM` over a tiny random-weight llama, its engine core in this process (`AsyncInprocClient`)."
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.testing import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    return AsyncLLM.from_engine_args(EngineArgs(model=ckpt, max_model_len=512, seed=0, enable_prefix_caching=True,
                                                max_num_seqs=16), enable_multiprocessing=False)


def _fake_engine(tmp_path_factory):
    "`AsyncLLM` over the model-free `FakeEngineCoreClient` (chapter 50)."
    from minivllm.fake_client import make_fake_async_llm
    return make_fake_async_llm(max_model_len=1024, step_delay=0.002)


def num_free_blocks(client) -> int:
    "Free KV blocks of the engine core (the fake keeps a counter; the real one asks its block pool)."
    if hasattr(client, "num_free_blocks"): return client.num_free_blocks
    return client.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def engine_has_requests(client) -> bool:
    "Whether the engine core still holds a request (read from the test thread: a snapshot)."
    if hasattr(client, "requests"): return bool(client.requests)
    return client.engine_core.scheduler.has_requests()


def is_fake(server) -> bool: return type(server.engine).__name__ == "FakeEngineCoreClient"


class Server:
    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.engine_core
        self.app = build_app_for_engine(self.llm, ["tiny"], api_key=API_KEY)
        self.thread = ServerThread(self.app).start()
        self.url = self.thread.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def post(self, path, body=None, raw=None, key=API_KEY):
        "POST JSON (or raw bytes); (status, parsed JSON body)."
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json",
                                                                           "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r: return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e: return e.code, json.loads(e.read())

    def get(self, path) -> str:
        with urllib.request.urlopen(self.url + path, timeout=60) as r: return r.read().decode()

    def count_tokens(self, **body) -> int:
        status, res = self.post("/tokenize", {"model": "tiny", **body})
        assert status == 200, res
        return res["count"]

    def wait_idle(self, timeout=30.0):
        "Wait (polling) until the engine has no request left; the deadline only keeps a broken test from hanging."
        deadline = time.monotonic() + timeout
        while engine_has_requests(self.engine) or self.llm.get_num_unfinished_requests():
            assert time.monotonic() < deadline, f"engine did not become idle: {self.engine_state()}"
            time.sleep(0.01)

    def engine_state(self) -> str:
        "What the engine still holds (for a failed wait): the scheduler's queues and held blocks, the front end's."
        s = getattr(getattr(self.engine, "engine_core", None), "scheduler", None)
        if s is None:
            return f"{self.llm.get_num_unfinished_requests()} unfinished in the front end"
        return (f"waiting {[r.request_id for r in s.waiting]}, running {[r.request_id for r in s.running]}, "
                f"finished {sorted(s.finished_req_ids)}, delayed free {sorted(s.delayed_free_req_ids)}, "
                f"front end {self.llm.get_num_unfinished_requests()} unfinished")  # fmt: skip

    def stop(self):
        self.thread.stop()
        self.llm.shutdown()


@pytest.fixture(scope="module", params=["real", "fake"])
def server(request, tmp_path_factory):
    make = _real_engine if request.param == "real" else _fake_engine
    srv = Server(make(tmp_path_factory))
    yield srv
    srv.stop()


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Count to three."}]


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert server.get("/health") == ""


def test_completion_usage_counts(server):
    prompt = "The quick brown fox"
    r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.prompt_tokens == server.count_tokens(prompt=prompt)
    assert r.usage.completion_tokens == 6 == len(r.choices[0].logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.choices[0].finish_reason == "length"
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text


def test_chat_multi_turn(server):
    r = server.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == server.count_tokens(messages=CHAT)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_streaming_chat_matches_greedy(server):
    kw = dict(model="tiny", messages=CHAT, max_completion_tokens=12, temperature=0)
    whole = server.client.chat.completions.create(**kw)
    chunks = list(server.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_completion_matches_greedy(server):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = server.client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in server.client.completions.create(**kw, stream=True) if c.choices)
    assert text == whole.choices[0].text


def test_n2(server):
    r = server.client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_completion_tokens=8, temperature=1.0,
                                              seed=1234, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    again = server.client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_completion_tokens=8, temperature=1.0,
                                                  seed=1234, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]   # seeded: reproducible


def test_stop_string(server):
    kw = dict(model="tiny", prompt="Numbers:", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = server.client.completions.create(**kw).choices[0].text
    assert len(text) >= 6
    stop = text[3:5]
    cut = text.find(stop)
    r = server.client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop


def test_logprobs(server):
    r = server.client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for tok_lp, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert tok_lp <= 0 and 1 <= len(tops) <= 3
        assert abs(tok_lp - max(tops.values())) < 1e-4       # greedy: the sampled token is the most likely
    c = server.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


BAD = [  # (path, body or raw bytes, expected param, words the message must contain)
    ("/v1/completions", b"{this is not json", None, "JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "lots"}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hello " * 2000}, "prompt", "maximum context length"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100_000}, "max_tokens", "maximum context length"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p", "top_p"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 0}, "n", "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "presence_penalty": 5}, "presence_penalty", "presence_penalty"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_k": -5}, "top_k", "top_k"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages", "messages"),
]


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_request_then_good_one(server, path, body, param, words):
    status, err = server.post(path, raw=body) if isinstance(body, bytes) else server.post(path, body)
    assert status == 400, err
    assert set(err) == {"error"} and err["error"]["code"] == 400 and err["error"]["param"] == param
    assert words in err["error"]["message"]
    ok = server.client.completions.create(model="tiny", prompt="fine", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_unknown_model_is_404_not_found(server):
    "vLLM v0.15 `_check_model`: an unknown model is a 404 NotFoundError naming `model`; the server keeps serving."
    status, err = server.post("/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert status == 404, err
    assert err == {"error": {"message": "The model `no-such-model` does not exist.", "type": "NotFoundError",
                             "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="no-such-model", messages=CHAT, max_completion_tokens=2)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    ok = server.client.completions.create(model="tiny", prompt="fine", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_api_key(server):
    status, err = server.post("/v1/completions", {"model": "tiny", "prompt": "x"}, key="wrong")
    assert status == 401 and err["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_client_disconnect_frees_kv_blocks(server):
    server.wait_idle()
    idle = num_free_blocks(server.engine)
    stream = server.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=100, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    got = [c for _, c in zip(range(3), stream)]
    assert len(got) == 3 and num_free_blocks(server.engine) < idle
    stream.close()
    server.wait_idle()
    deadline = time.monotonic() + 30
    while num_free_blocks(server.engine) != idle:
        assert time.monotonic() < deadline, (num_free_blocks(server.engine), idle)
        time.sleep(0.01)


def _metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(server.get("/metrics")) for s in fam.samples}


def test_metrics_move_by_known_amounts(server):
    server.wait_idle()
    m = (("model_name", "tiny"),)
    ok = (("finished_reason", "length"), ("model_name", "tiny"))
    before = _metrics(server)
    prompt = "Metrics are counted"
    r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    server.wait_idle()
    after = _metrics(server)
    def delta(key): return after.get(key, 0.0) - before.get(key, 0.0)
    assert delta(("vllm:prompt_tokens_total", m)) == r.usage.prompt_tokens == server.count_tokens(prompt=prompt)
    assert delta(("vllm:generation_tokens_total", m)) == 5
    assert delta(("vllm:request_success_total", ok)) == 1
    assert delta(("vllm:e2e_request_latency_seconds_count", m)) == 1
    assert delta(("vllm:time_to_first_token_seconds_count", m)) == 1
    assert delta(("vllm:request_time_per_output_token_seconds_count", m)) == 1
    me = (("engine", "0"), ("model_name", "tiny"))  # fed from SchedulerStats: one series per engine
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (name, me) in after, name


def test_bad_requests_do_not_disturb_a_running_stream(server):
    import threading
    kw = dict(model="tiny", messages=CHAT, max_completion_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    expected = server.client.chat.completions.create(**kw).choices[0].message.content
    got = {}
    def consume():
        got["text"] = "".join(c.choices[0].delta.content or "" for c in server.client.chat.completions.create(**kw, stream=True)
                              if c.choices)
    t = threading.Thread(target=consume)
    t.start()
    for path, body, _, _ in BAD:
        status, _ = server.post(path, raw=body) if isinstance(body, bytes) else server.post(path, body)
        assert status == 400
    t.join(60)
    assert got["text"] == expected


def _launch_serve(tmp_path, args: list[str], env_extra: dict | None = None, reuse_checkpoint: bool = False,
                  new_session: bool = False):
    """Start `minivllm serve` on a tiny llama checkpoint in a subprocess (one OMP thread, `args` after the port);
    return (process, port) once /health answers. `reuse_checkpoint`: serve the one already in `tmp_path / "tiny"`
    (made with other settings). `new_session`: in a session (and process group) of its own, whose id is the
    process's pid, for signals sent to the whole group. Raises AssertionError (after killing it) if the server exits or is not up within
    120 s."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path
    from minivllm.testing import make_tiny_checkpoint
    ckpt = str(tmp_path / "tiny") if reuse_checkpoint else make_tiny_checkpoint("llama", tmp_path / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from minivllm.entrypoints.cli.main import main; sys.exit(main())",
                             "serve", ckpt, "--host", "127.0.0.1", "--port", str(port), *args, "--uvicorn-log-level", "warning"],
                            cwd=repo, env=env, start_new_session=new_session)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, "server exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2); break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.3)
    except BaseException:
        proc.kill(); proc.wait(30)
        raise
    return proc, port


def test_minivllm_serve_cli(tmp_path):
    "`minivllm serve CKPT --port P ...` in its own process answers the openai client, then stops on SIGTERM."
    pytest.importorskip("minivllm.v1.engine.llm_engine")
    proc, port = _launch_serve(tmp_path, ["--served-model-name", "tiny", "alias", "--api-key", API_KEY, "--max-model-len", "256",
                                          "--max-num-seqs", "8", "--block-size", "16", "--no-enable-prefix-caching", "--seed", "3"])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
        r = client.chat.completions.create(model="alias", messages=CHAT, max_completion_tokens=4, extra_body={"ignore_eos": True})
        assert r.model == "alias" and r.usage.completion_tokens == 4
        models = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})).read())
        assert models["data"][0]["max_model_len"] == 256
    finally:
        proc.terminate()
        proc.wait(30)


def test_metrics_prefix_cache_hits(server):
    if is_fake(server): pytest.skip("the fake engine has no prefix cache")
    server.wait_idle()
    m = (("engine", "0"), ("model_name", "tiny"))
    prompt = "A shared prefix long enough to fill several KV cache blocks of sixteen tokens, " * 3
    first = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    server.wait_idle()
    before = _metrics(server)
    server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    server.wait_idle()
    after = _metrics(server)
    n = first.usage.prompt_tokens
    assert after[("vllm:prefix_cache_queries_total", m)] - before[("vllm:prefix_cache_queries_total", m)] == n
    hits = after[("vllm:prefix_cache_hits_total", m)] - before[("vllm:prefix_cache_hits_total", m)]
    assert hits == (n - 1) // 16 * 16      # every full block but the one holding the last prompt token
    assert ("vllm:prefix_cache_hit_rate", m) not in after    # not a vLLM v1 series: hits / queries is the dashboard's


def _serve_in_subprocess(tmp_path, env_extra: dict | None = None):
    """Start `minivllm serve` on a tiny checkpoint with its own $TMPDIR; returns (process, port, tmpdir, engine pid)
    once /health answers."""
    from pathlib import Path
    tmpdir = tmp_path / "tmp"; tmpdir.mkdir()
    proc, port = _launch_serve(tmp_path, ["--max-model-len", "128"],
                               {"TMPDIR": str(tmpdir), "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env_extra or {})})
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try: fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError: continue
        if int(fields[1]) == proc.pid: children.append(int(stat.parent.name))
    # the engine is the child that is not multiprocessing's resource tracker (forked: the server's command line)
    engine = [pid for pid in children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    if not engine:  # a failing test must not leave its server running (its engine follows its parent)
        proc.kill(); proc.wait(30)
    assert engine, "no engine process found"
    return proc, port, tmpdir, engine[0]


def _gone(pid: int) -> bool:
    import os
    try: os.kill(pid, 0)
    except ProcessLookupError: return True
    try:
        with open(f"/proc/{pid}/stat") as f: return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError: return True


def test_serve_sigterm_shuts_down_like_ctrl_c(tmp_path):
    "SIGTERM (docker stop, systemd, k8s) stops the engine and removes its IPC socket files, as Ctrl-C does."
    import signal
    proc, port, tmpdir, engine_pid = _serve_in_subprocess(tmp_path)
    try:
        assert any(p.name.startswith("minivllm-") for p in tmpdir.iterdir())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None: proc.kill()
    deadline = time.monotonic() + 10
    while not _gone(engine_pid) and time.monotonic() < deadline: time.sleep(0.1)
    assert _gone(engine_pid)
    assert [p.name for p in tmpdir.iterdir()] == []


def test_serve_exits_when_the_engine_dies(tmp_path):
    "A server whose engine died exits with a non-zero status (so a supervisor restarts it) instead of answering 500 forever."
    import signal
    import os
    proc, port, tmpdir, engine_pid = _serve_in_subprocess(tmp_path)
    try:
        os.kill(engine_pid, signal.SIGKILL)
        rc = proc.wait(30)
        assert rc not in (0, None)
    finally:
        if proc.poll() is None: proc.kill()
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("minivllm-")] == []


def test_serve_keep_alive_on_engine_death(tmp_path):
    "MINIVLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps the server up after the engine died; /health then says 503."
    import signal
    import os
    proc, port, tmpdir, engine_pid = _serve_in_subprocess(tmp_path, {"MINIVLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    try:
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5); time.sleep(0.2)
            except urllib.error.HTTPError as e:
                assert e.code == 503; break
        else: raise AssertionError("/health never reported the dead engine")
        time.sleep(2)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_on_a_taken_port_fails_before_the_model_loads(tmp_path):
    """`minivllm serve` binds its socket before it builds the engine (vLLM's `setup_server`): a taken port
    exits with 2 and an error naming `--host`/`--port` at once. The model folder does not even exist, so an
    engine built first would fail on the model instead."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-c", "import sys; from minivllm.entrypoints.cli.main import main; sys.exit(main())",
                               "serve", str(tmp_path / "no-such-model"), "--host", "127.0.0.1", "--port", str(port)],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: --host 127.0.0.1 --port {port}: cannot listen there" in done.stderr, done.stderr[-2000:]
    assert "no-such-model" not in done.stderr


def test_cache_salt_keeps_tenants_prefix_caches_apart(server):
    """vLLM's `cache_salt`: a request finds prefix-cached KV only from requests with the same salt (one tenant
    cannot probe another's prompts by timing). It was refused as unsupported; now it reaches the engine."""
    if is_fake(server): pytest.skip("the fake engine has no prefix cache")
    m = (("engine", "0"), ("model_name", "tiny"))
    prompt = "Tenant data that fills a few KV cache blocks of sixteen tokens each, and more words. " * 3

    def hits(**extra) -> float:
        server.wait_idle()
        before = _metrics(server)[("vllm:prefix_cache_hits_total", m)]
        r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        server.wait_idle()
        return _metrics(server)[("vllm:prefix_cache_hits_total", m)] - before, r.choices[0].text

    first, text = hits(cache_salt="tenant-a")
    again, text_again = hits(cache_salt="tenant-a")
    other, text_other = hits(cache_salt="tenant-b")
    unsalted, _ = hits()
    assert first == 0 and again > 0, (first, again)    # the same salt shares its blocks
    assert other == 0 and unsalted == 0, (other, unsalted)  # another salt, or none, shares nothing
    chat = server.client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=2,
                                                 extra_body={"cache_salt": "tenant-a"})
    assert chat.usage.completion_tokens >= 1
    assert text == text_again == text_other


def test_serve_on_port_0_logs_the_port_it_serves_on(tmp_path):
    """`--port 0` binds a free port; the port is logged on uvicorn's logger (shown by --uvicorn-log-level),
    where a user (or a script) can read it: the minivllm logger's INFO line was never shown by `serve`."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path
    from minivllm.testing import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from minivllm.entrypoints.cli.main import main; sys.exit(main())",
                             "serve", ckpt, "--host", "127.0.0.1", "--port", "0", "--max-model-len", "128"],
                            cwd=repo, env=env, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True)  # until it closes
        reader.start()
        deadline, port = time.monotonic() + 120, None
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)[-3000:]
            found = re.search(r"minivllm serving \['[^']*'\] on http://127\.0\.0\.1:(\d+)", "".join(seen))
            port = int(found.group(1)) if found else None
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "".join(seen)[-3000:]
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
