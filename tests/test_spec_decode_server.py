"""`--speculative-config` on the CLI and the OpenAI server, and the vllm:spec_decode_* counters on /metrics.

The server runs in-process on 127.0.0.1 (a free port) over a tiny random Llama with the target as its own draft
(every greedy draft accepted), and is stopped at the end of the module.
"""
import json
import urllib.request

import pytest

pytest.importorskip("fastapi")

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.cli.main import main
from minivllm.entrypoints.llm import LLM
from minivllm.entrypoints.openai.api_server import ServerThread, build_app_for_engine
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.v1.engine.async_llm import AsyncLLM

PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(ckpt, dtype="float32", max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_generate_cli_flag(ckpt, capsys):
    base = ["generate", "hello hello hello", "--model", ckpt, "--dtype", "float32", "--max-tokens", "12",
            "--max-model-len", "128", "--ignore-eos"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    spec = json.dumps({"model": ckpt, "num_speculative_tokens": 3})
    assert main([*base, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain
    assert main([*base, "--speculative-config", '{"num_speculative_tokens": 99}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_server_with_speculation(ckpt, reference):
    spec = {"model": ckpt, "num_speculative_tokens": 3}
    args = EngineArgs(model=ckpt, dtype="float32", max_model_len=128, speculative_config=spec)
    llm = AsyncLLM.from_engine_args(args, enable_multiprocessing=False)
    thread = ServerThread(build_app_for_engine(llm, ["tiny"])).start()
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(thread.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            res = json.loads(r.read())
        assert res["usage"]["completion_tokens"] == 20
        assert res["choices"][0]["text"] == llm.get_tokenizer().decode(reference)
        with urllib.request.urlopen(thread.url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode") and "position" not in line}
        assert values["vllm:spec_decode_num_drafts_total"] > 0
        assert values["vllm:spec_decode_num_accepted_tokens_total"] == values["vllm:spec_decode_num_draft_tokens_total"]
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in metrics
    finally:
        thread.stop()
        llm.shutdown()
