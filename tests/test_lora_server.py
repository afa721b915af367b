"""LoRA through the OpenAI-compatible server and the official `openai` client (issue 32): `--lora-modules`
adapters listed by /v1/models with the base model as parent, a request's `model` selecting the adapter
(the same tokens as `LLM.generate` with that `LoRARequest`), runtime load / unload behind
MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING, bad adapters as 400s naming the field, unknown ones as 404 on unload
and as a request's `model` (openai.NotFoundError, as vLLM), and the server serving on after every refusal.
The server runs in-process on 127.0.0.1."""

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from minivllm.engine.arg_utils import EngineArgs  # noqa: E402
from minivllm.entrypoints.llm import LLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app_for_engine  # noqa: E402
from minivllm.entrypoints.openai.serving_models import LoRAModulePath  # noqa: E402
from minivllm.lora.models import make_random_lora_adapter  # noqa: E402
from minivllm.lora.request import LoRARequest  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.testing import make_tiny_checkpoint  # noqa: E402
from minivllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

PROMPT = "hello world, this is"
LORA_ARGS = dict(enable_lora=True, max_lora_rank=8, max_loras=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lora_server")
    path = make_tiny_checkpoint("llama", root / "base")
    cfg = transformers.AutoConfig.from_pretrained(path)
    adapters = {
        name: make_random_lora_adapter(str(root / name), cfg, rank=rank, seed=seed)
        for name, rank, seed in (("sql", 8, 1), ("chat", 4, 2), ("big", 16, 3))
    }
    offline = LLM(path, max_model_len=128, seed=0, **LORA_ARGS)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = {
        name: offline.generate(PROMPT, sp, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        for name, lora in (
            ("tiny", None),
            ("sql", LoRARequest("sql", 1, adapters["sql"])),
            ("chat", LoRARequest("chat", 2, adapters["chat"])),
        )
    }
    del offline
    return path, adapters, expected


@pytest.fixture(scope="module")
def server(setup):
    path, adapters, _ = setup
    mp = pytest.MonkeyPatch()
    mp.setenv("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=path, max_model_len=128, seed=0, **LORA_ARGS), enable_multiprocessing=False
    )
    app = build_app_for_engine(llm, ["tiny"], lora_modules=[LoRAModulePath("sql", adapters["sql"])])
    mp.undo()
    thread = ServerThread(app).start()
    try:
        yield thread.url, openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        thread.stop()
        llm.shutdown()


def _post(url, path, body):
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(client, model):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text


def test_models_list_adapters_with_parent(server):
    _, client = server
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "sql"]
    assert cards["sql"].parent == "tiny"


def test_model_selects_the_adapter(server, setup):
    _, client = server
    expected = setup[2]
    assert _complete(client, "sql") == expected["sql"]
    assert _complete(client, "tiny") == expected["tiny"]
    assert expected["sql"] != expected["tiny"]


def test_runtime_load_unload_and_refusals(server, setup):
    url, client = server
    _, adapters, expected = setup
    status, body = _post(url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})
    assert status == 200, body
    assert _complete(client, "chat") == expected["chat"]
    assert "chat" in [m.id for m in client.models.list().data]
    for payload, param in (
        ({"lora_name": "big", "lora_path": adapters["big"]}, "r"),  # rank 16 > --max-lora-rank 8
        ({"lora_name": "nowhere", "lora_path": "/nonexistent/adapter"}, "lora_path"),
        ({"lora_name": "sql", "lora_path": adapters["chat"]}, "lora_name"),  # already served
        ({"lora_name": "x"}, "lora_path"),
    ):
        status, err = _post(url, "/v1/load_lora_adapter", payload)
        assert status == 400 and err["error"]["param"] == param, (payload, err)
    with pytest.raises(openai.NotFoundError) as e:  # never loaded: an unknown model, vLLM's 404
        _complete(client, "big")
    assert e.value.body["param"] == "model" and e.value.body["message"] == "The model `big` does not exist."
    status, body = _post(url, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        _complete(client, "chat")
    status, err = _post(url, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and err["error"]["type"] == "NotFoundError"
    assert _complete(client, "sql") == expected["sql"]  # still serving, adapters and base alike
    assert _complete(client, "tiny") == expected["tiny"]


def test_lora_requests_info_metric(server):
    url, client = server
    _complete(client, "sql")
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert lines, "no vllm:lora_requests_info series"
    assert all('max_lora="2"' in line for line in lines)
    assert any('running_lora_adapters="sql"' in line for line in lines), lines


def test_runtime_updates_off_by_default(setup):
    path, adapters, _ = setup
    from minivllm.fake_client import make_fake_async_llm

    app = build_app_for_engine(make_fake_async_llm(max_model_len=64), ["tiny"])
    with ServerThread(app) as thread:
        status, _ = _post(
            thread.url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}
        )
    assert status == 404


def test_lora_modules_need_enable_lora():
    from minivllm.fake_client import make_fake_async_llm

    with pytest.raises(ValueError, match="enable_lora"):
        build_app_for_engine(
            make_fake_async_llm(max_model_len=64), ["tiny"], lora_modules=[LoRAModulePath("a", "/x")]
        )
