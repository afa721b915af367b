"""The OpenAI server's structured outputs (response_format, vLLM's structured_outputs field) and prefill/decode
disaggregation through two `minivllm serve` processes and the toy proxy, all with the official `openai` client."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from test_server import API_KEY, Server, _launch_serve, _real_engine

pytest.importorskip("xgrammar")
REPO = Path(__file__).resolve().parents[1]
YES_NO = {"type": "string", "enum": ["yes", "no"]}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    srv = Server(_real_engine(tmp_path_factory))
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(real, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": YES_NO}}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "yes or no?"}], max_completion_tokens=12,
              temperature=0.9, response_format=fmt)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in real.client.chat.completions.create(stream=True, **kw))
    else:
        text = real.client.chat.completions.create(**kw).choices[0].message.content
    assert json.loads(text) in ("yes", "no"), text


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_extra_field(real, stream):
    kw = dict(model="tiny", prompt="digits:", max_tokens=10, temperature=1.0, n=3,
              extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    if stream:
        texts = {}
        for c in real.client.completions.create(stream=True, **kw):
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        texts = list(texts.values())
    else:
        texts = [c.text for c in real.client.completions.create(**kw).choices]
    assert len(texts) == 3 and all(re.fullmatch("[0-9]{3}", t) for t in texts), texts
    r = real.client.completions.create(model="tiny", prompt="pick", max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert r.choices[0].text in ("red", "green")


def test_bad_schema_is_a_400_naming_response_format(real):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": 5}}}}
    with pytest.raises(openai.BadRequestError) as e:
        real.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            response_format=fmt, max_completion_tokens=4)
    assert e.value.body["param"] == "response_format"
    assert real.client.completions.create(model="tiny", prompt="still fine", max_tokens=2).choices[0].text is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMPUTED = "vllm:request_prefill_kv_computed_tokens"


def _metrics(port: int) -> dict[str, float]:
    "The server's /metrics samples without labels: name -> value (one model, so no clashes we read)."
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if "le" not in s.labels}


def test_prefill_decode_servers_through_the_proxy(tmp_path):
    common = ["--served-model-name", "tiny", "--max-model-len", "256", "--block-size", "16", "--seed", "0"]
    kv_port = _free_port()
    prod_cfg = json.dumps({"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": kv_port})
    cons_cfg = json.dumps({"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"transfer_timeout_s": 20}})
    procs = []
    try:
        single, single_port = _launch_serve(tmp_path, common)
        procs.append(single)
        prod, prod_port = _launch_serve(tmp_path, [*common, "--kv-transfer-config", prod_cfg], reuse_checkpoint=True)
        procs.append(prod)
        cons, cons_port = _launch_serve(tmp_path, [*common, "--kv-transfer-config", cons_cfg], reuse_checkpoint=True)
        procs.append(cons)
        proxy_port = _free_port()
        proxy = subprocess.Popen([sys.executable, str(REPO / "examples" / "disagg_proxy.py"), "--port", str(proxy_port),
                                  "--prefill", f"http://127.0.0.1:{prod_port}", "--decode", f"http://127.0.0.1:{cons_port}"],
                                 cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        procs.append(proxy)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/health", timeout=2)
                break
            except OSError:
                assert proxy.poll() is None and time.monotonic() < deadline, "proxy did not start"
                time.sleep(0.3)
        one = openai.OpenAI(base_url=f"http://127.0.0.1:{single_port}/v1", api_key="x", max_retries=0, timeout=60)
        pd = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="x", max_retries=0, timeout=60)
        prompt = "The quick brown fox jumps over the lazy dog, " * 3
        kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        ref = one.completions.create(**kw)
        want, n_prompt = ref.choices[0].text, ref.usage.prompt_tokens
        got = "".join(c.choices[0].text for c in pd.completions.create(stream=True, **kw))
        assert got == want
        # a transfer, not a recompute (issue 30, item 12): the consumer computed one prompt token, the last
        # (vllm:request_prefill_kv_computed_tokens = prompt - cached); its connector was asked for the whole
        # prompt and claimed it (vllm:external_prefix_cache_*); the single instance computed every token
        deadline = time.monotonic() + 10
        while (cons := _metrics(cons_port)).get(COMPUTED + "_count", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (cons.get(COMPUTED + "_count"), cons.get(COMPUTED + "_sum")) == (1, 1), cons
        assert (cons["vllm:external_prefix_cache_queries_total"], cons["vllm:external_prefix_cache_hits_total"]) \
            == (n_prompt, n_prompt)
        single_metrics = _metrics(single_port)
        assert single_metrics[COMPUTED + "_sum"] == n_prompt
        assert single_metrics["vllm:external_prefix_cache_queries_total"] == 0  # no connector there
        chat = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_completion_tokens=6,
                    temperature=0, extra_body={"ignore_eos": True})
        assert pd.chat.completions.create(**chat).choices[0].message.content == \
            one.chat.completions.create(**chat).choices[0].message.content
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
