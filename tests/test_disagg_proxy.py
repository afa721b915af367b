"""The toy disaggregation proxy (examples/disagg_proxy.py) when a backend is dead, drops the connection,
answers plain text or breaks a stream (issue 30, item 4): every answer keeps OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`, 503 for a backend that cannot be reached, 502 for one that
failed; a stream that breaks after it started ends with an `error` event. The backends are stand-ins on free
ports of 127.0.0.1 (a socket nobody listens on, a socket that closes every connection, tiny HTTP servers), so
no engine is needed; every server the tests start is stopped."""

import importlib.util
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("disagg_proxy", REPO / "examples" / "disagg_proxy.py")
disagg_proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(disagg_proxy)

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 4}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Dropper:
    "Accepts every connection, reads the request, closes without a word (a producer killed mid-request)."

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)  # accept() wakes up to see `stop` (closing the socket would not wake it)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                except OSError:
                    pass

    def stop(self):
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close()


class _Backend:
    """A tiny HTTP backend: POSTs answer `reply(path, body) -> (status, content_type, bytes)`, or, when
    `break_stream` is set, send headers and one chunk of an event stream and then drop the connection."""

    def __init__(self, reply=None, break_stream=False):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.break_stream:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    event = b'data: {"choices": [{"index": 0, "text": "he"}]}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.write(b"400\r\npartial")  # a chunk of 1024 bytes that never completes
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, ctype, content = outer.reply(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.reply, self.break_stream = reply, break_stream
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _prefill_ok(path, body):
    return 200, "application/json", json.dumps({"kv_transfer_params": {"do_remote_prefill": True}}).encode()


def _plain_500(path, body):
    return 500, "text/plain", b"Internal Server Error"


@pytest.fixture
def servers():
    started = []

    def start(kind, **kw):
        server = _Dropper() if kind == "dropper" else _Backend(**kw)
        started.append(server)
        return server.url

    yield start
    for server in started:
        server.stop()


def _proxy(prefill: str, decode: str) -> TestClient:
    return TestClient(disagg_proxy.build_app(prefill, decode, timeout_s=10))


def _assert_openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize("path, body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_dead_producer_is_a_503_in_openai_shape(servers, path, body, stream):
    dead = f"http://127.0.0.1:{_free_port()}"
    with _proxy(dead, servers("backend", reply=_prefill_ok)) as client:
        error = _assert_openai_error(client.post(path, json=dict(body, stream=stream)), 503)
    assert "prefill server is unavailable" in error["message"] and error["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize("stream", [False, True])
def test_dropped_connection_is_a_502(servers, stream):
    "A producer that dies mid-request (httpx.RemoteProtocolError): it was a plain-text 500 before."
    with _proxy(servers("dropper"), servers("backend", reply=_prefill_ok)) as client:
        error = _assert_openai_error(client.post("/v1/completions", json=dict(BODY, stream=stream)), 502)
        # closed before any answer: RemoteProtocolError, or ReadError when the close comes as a reset
        assert any(e in error["message"] for e in ("RemoteProtocolError", "ReadError", "WriteError"))
        assert error["type"] == "BadGatewayError"
    with _proxy(servers("backend", reply=_prefill_ok), servers("dropper")) as client:  # the decode server
        _assert_openai_error(client.post("/v1/completions", json=dict(BODY, stream=stream)), 502)


def test_backend_errors_keep_their_status_in_openai_shape(servers):
    with _proxy(servers("backend", reply=_plain_500), servers("backend", reply=_prefill_ok)) as client:
        error = _assert_openai_error(client.post("/v1/completions", json=BODY), 500)
        assert "Internal Server Error" in error["message"]
        _assert_openai_error(client.post("/v1/completions", content=b"{not json"), 400)
        _assert_openai_error(client.post("/v1/completions", json=["a", "list"]), 400)
    dead = f"http://127.0.0.1:{_free_port()}"
    with _proxy(dead, dead) as client:
        _assert_openai_error(client.get("/v1/models"), 503)
        assert client.get("/health").status_code == 503


def test_stream_broken_midway_ends_with_an_error_event(servers):
    with _proxy(servers("backend", reply=_prefill_ok), servers("backend", break_stream=True)) as client:
        r = client.post("/v1/completions", json=dict(BODY, stream=True))
        assert r.status_code == 200  # the stream had started: the status is already sent
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "he"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    assert events[-1] == "[DONE]"


def test_a_stopped_backend_is_a_502_after_the_timeout_and_unhealthy_at_once():
    """A backend stopped with `kill -STOP`: the kernel completes the TCP handshake (its listen backlog), nobody
    reads or answers. The proxy waited 600 s (its fixed httpx timeout) for each request and for `/health`;
    `--timeout` bounds a request, and `/health` waits `--health-timeout` (5 s) whatever `--timeout` is."""
    import subprocess
    import sys
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # never accept()ed: a stopped process
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        with TestClient(disagg_proxy.build_app(url, url, timeout_s=1.0, health_timeout_s=0.5)) as client:
            t0 = time.monotonic()
            error = _assert_openai_error(client.post("/v1/completions", json=BODY), 502)
            assert "ReadTimeout" in error["message"] and time.monotonic() - t0 < 10
        with TestClient(disagg_proxy.build_app(url, url, health_timeout_s=0.5)) as client:  # timeout_s 600
            t0 = time.monotonic()
            assert client.get("/health").status_code == 503
            assert time.monotonic() - t0 < 10
    finally:
        silent.close()
    for bad in (0, -1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="timeout_s must be a positive, finite number of seconds"):
            disagg_proxy.build_app(url, url, timeout_s=bad)
    script = str(REPO / "examples" / "disagg_proxy.py")
    for flag in ("--timeout", "--health-timeout"):
        r = subprocess.run([sys.executable, script, "--prefill", url, "--decode", url, flag, "0"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (
            r.returncode == 2 and f"argument {flag}: must be a positive, finite number of seconds" in r.stderr
        )


def test_the_prefill_request_carries_no_decode_limits(servers):
    """A valid request with `min_tokens` (here 5 of 10) was the producer's 400 "min_tokens must be <= max_tokens=1":
    the proxy copied it into the one-token prefill. The prefill now drops the decode's limits (min_tokens, stops)
    and ignores EOS (a stopped prefill hands over no blocks); the decode server gets the request as sent."""
    seen = {}

    def record(name):
        def reply(path, body):
            seen[name] = body
            return _prefill_ok(path, body)

        return reply

    body = dict(BODY, max_tokens=10, min_tokens=5, stop=["\n"], stop_token_ids=[7], max_completion_tokens=10)
    with _proxy(
        servers("backend", reply=record("prefill")), servers("backend", reply=record("decode"))
    ) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    prefill, decode = seen["prefill"], seen["decode"]
    assert (prefill["max_tokens"], prefill["n"], prefill["ignore_eos"]) == (1, 1, True)
    assert not {"min_tokens", "stop", "stop_token_ids", "max_completion_tokens"} & set(prefill)
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert {k: decode[k] for k in body} == body  # the client's own request, plus the producer's parameters
    assert decode["kv_transfer_params"] == {"do_remote_prefill": True}


# --- break pass D (issue 30): backends that answer badly ---


def _reply_with(status, body: bytes, ctype="application/json"):
    def reply(path, req):
        return status, ctype, body

    return reply


@pytest.mark.parametrize(
    "answer, says",
    [
        (b'{"error": {"message": "engine overloaded"}}', "answered with an error: "),  # a 200 with an error
        (b'{"kv_transfer_params": [1, 2]}', "kv_transfer_params is not an object"),  # the client sent no such
    ],
)
def test_a_prefill_answer_that_is_no_answer_is_a_502(servers, answer, says):
    "They went on (recomputed without a word), or were a 400 blaming the client for a field it never sent."
    prefill = servers("backend", reply=_reply_with(200, answer))
    with _proxy(prefill, servers("backend", reply=_prefill_ok)) as client:
        error = _assert_openai_error(client.post("/v1/completions", json=BODY), 502)
    assert says in error["message"] and error["param"] is None


def test_a_decode_answer_that_is_not_json_is_a_502_and_the_500_type_is_not_doubled(servers):
    decode = servers("backend", reply=_reply_with(200, b"\x00\xff<html>not json", "text/html"))
    with _proxy(servers("backend", reply=_prefill_ok), decode) as client:
        error = _assert_openai_error(client.post("/v1/completions", json=BODY), 502)
        assert "not JSON" in error["message"]
    with _proxy(servers("backend", reply=_plain_500), servers("backend", reply=_prefill_ok)) as client:
        assert (
            _assert_openai_error(client.post("/v1/completions", json=BODY), 500)["type"]
            == "InternalServerError"
        )


def test_a_trickling_or_huge_prefill_answer_is_a_502_in_time(servers, monkeypatch):
    "httpx's timeout bounds each read: a byte a second held the client minutes; 300 MiB answers were read whole."
    import time

    class Trickle(_Backend):
        def __init__(self):
            super().__init__(reply=_prefill_ok)
            handler = self.server.RequestHandlerClass

            def do_POST(h):
                h.rfile.read(int(h.headers["Content-Length"]))
                h.send_response(200)
                h.send_header("Content-Type", "application/json")
                h.send_header("Content-Length", "1000")
                h.end_headers()
                for _ in range(30):  # 30 s, one byte a second
                    try:
                        h.wfile.write(b" ")
                        h.wfile.flush()
                    except OSError:
                        return
                    time.sleep(1)

            handler.do_POST = do_POST

    trickle = Trickle()
    try:
        with TestClient(disagg_proxy.build_app(trickle.url, trickle.url, timeout_s=2)) as client:
            t0 = time.monotonic()
            error = _assert_openai_error(client.post("/v1/completions", json=BODY), 502)
            assert "within 2 s" in error["message"] and time.monotonic() - t0 < 10
    finally:
        trickle.stop()
    monkeypatch.setattr(disagg_proxy, "MAX_PREFILL_ANSWER_BYTES", 1000)
    huge = servers("backend", reply=_reply_with(200, b'{"pad": "' + b"x" * 5000 + b'"}'))
    with _proxy(huge, servers("backend", reply=_prefill_ok)) as client:
        error = _assert_openai_error(client.post("/v1/completions", json=BODY), 502)
    assert "over 1000 bytes" in error["message"]
