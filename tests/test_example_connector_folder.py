"""ExampleConnector / ECExampleConnector: the storage folder and what is found in it (pass 17).

1. The `shared_storage_path` folder removed while the engine runs was never made again: every later save
   failed, one warning per block and step, forever. It is made again by the next save (logged once).
2. A file at a block's key whose tensors are not this cache's layout (a well-formed safetensors file of other
   tensors, or a symlink to the checkpoint's `model.safetensors`) was refused on every request and never
   replaced. It is deleted like a damaged file (a symlink itself, never its target), and stored again.
3. `shared_storage_path` of the wrong type (5, null) or naming an existing file stopped the engine with a bare
   `TypeError` / `FileExistsError`; it is a `ValueError` naming the field, for both connectors.
"""

import logging
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minivllm import LLM, SamplingParams
from minivllm.config import ECTransferConfig
from minivllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from minivllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from minivllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group_or_none
from minivllm.testing import make_tiny_checkpoint

PROMPTS = [list(range(3, 3 + 40)), list(range(100, 100 + 37))]  # two full loadable blocks of 16 each
LOGGER = "minivllm.distributed.kv_transfer.kv_connector.v1.example_connector"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def want(ckpt):
    "The tokens without a connector."
    llm = _llm(ckpt)
    try:
        return _generate(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


def _kvt(folder):
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": folder}}  # fmt: skip


def _llm(ckpt, kvt=None):
    return LLM(ckpt, dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False,
               kv_transfer_config=kvt)  # fmt: skip


def _generate(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _block_files(prompt) -> list[Path]:
    "The files of `prompt`'s full blocks, through the running engine's connector."
    conn = get_kv_transfer_group_or_none()
    req = SimpleNamespace(prompt_token_ids=prompt, cache_salt=None, lora_request=None, mm_features=None)
    return [conn._path(key) for key in conn._keys(req)]


def _messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_removed_folder_is_made_again(ckpt, want, tmp_path, caplog):
    folder = tmp_path / "store"
    llm = _llm(ckpt, _kvt(str(folder)))
    try:
        assert _generate(llm, PROMPTS) == want
        shutil.rmtree(folder)  # an `rm -r` under the running engine
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            got = [_generate(llm, PROMPTS) for _ in range(3)]
            files = [f for p in PROMPTS for f in _block_files(p)]
    finally:
        llm.llm_engine.shutdown()
    assert got == [want] * 3
    assert folder.is_dir() and all(f.is_file() for f in files)  # before: gone, nothing stored again
    assert _messages(caplog, "cannot save") == []  # before: one per block and step
    assert len(_messages(caplog, "made it again")) == 1


def test_foreign_layout_files_are_deleted_and_stored_again(ckpt, want, tmp_path, caplog):
    folder = tmp_path / "store"
    weights = Path(ckpt) / "model.safetensors"
    size = weights.stat().st_size
    llm = _llm(ckpt, _kvt(str(folder)))
    try:
        assert _generate(llm, PROMPTS) == want
        planted, linked = _block_files(PROMPTS[0])[0], _block_files(PROMPTS[1])[1]
        layers = set(safe_open(planted, "pt").keys())
        save_file({"other": torch.zeros(2, 2)}, planted, metadata={"file": planted.name})  # well-formed
        linked.unlink()
        linked.symlink_to(weights)  # the checkpoint's own weights at a block's key
        for attempt in range(2):
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                caplog.clear()
                assert _generate(llm, PROMPTS) == want
                refused = _messages(caplog, "cannot load")
            if attempt == 0:  # both refused, both deleted (and computed, and stored)
                assert len(refused) == 2 and all("deleted" in m for m in refused), refused
        assert refused == []  # before: refused again on every request, never replaced
    finally:
        llm.llm_engine.shutdown()
    for f in (planted, linked):  # stored again: a regular file of this cache's layers
        assert f.is_file() and not f.is_symlink()
        assert set(safe_open(f, "pt").keys()) == layers
    assert weights.stat().st_size == size and set(safe_open(weights, "pt").keys()) != layers  # target intact


def test_bad_storage_path_names_the_field_at_start(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['shared_storage_path'\] must be"):
        _llm(ckpt, _kvt(5))  # before: TypeError: expected str, bytes or os.PathLike object, not int


@pytest.mark.parametrize("connector", ["kv", "ec"])
@pytest.mark.parametrize("value", [5, None, "", "a-file", "a-file/below"])
def test_bad_storage_path_is_a_value_error(connector, value, tmp_path):
    from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    (tmp_path / "a-file").write_text("not a folder")
    if isinstance(value, str) and value:
        value = str(tmp_path / value)
    extra = {"shared_storage_path": value}
    model = SimpleNamespace(model="toy", dtype=torch.float32)
    if connector == "kv":
        kvt = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_extra_config=extra)
        cfg = SimpleNamespace(
            kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=4), model_config=model
        )
        make = lambda: ExampleConnector(cfg, KVConnectorRole.SCHEDULER)  # noqa: E731
    else:
        ect = ECTransferConfig("ECExampleConnector", "ec_both", ec_connector_extra_config=extra)
        cfg = SimpleNamespace(
            ec_transfer_config=ect, device_config=SimpleNamespace(device="cpu"), model_config=model
        )
        make = lambda: ECExampleConnector(cfg, ECConnectorRole.SCHEDULER)  # noqa: E731
    with pytest.raises(
        ValueError, match=rf"{connector}_connector_extra_config\['shared_storage_path'\] must"
    ):
        make()  # before: TypeError, FileExistsError or NotADirectoryError naming no setting; "" was taken
    assert (tmp_path / "a-file").read_text() == "not a folder"


def test_cache_dtype_other_than_the_model_s_gets_other_keys():
    "A layout mismatch at a key is deleted: a KV cache of another dtype must never share the model's keys."
    from minivllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    def keys(cache_dtype, folder):
        kvt = SimpleNamespace(
            kv_connector="ExampleConnector", kv_connector_extra_config={"shared_storage_path": folder}
        )
        model = SimpleNamespace(model="toy", dtype=torch.float32)
        cache = SimpleNamespace(block_size=4, cache_dtype=cache_dtype)
        cfg = SimpleNamespace(kv_transfer_config=kvt, model_config=model, cache_config=cache)
        req = SimpleNamespace(
            prompt_token_ids=list(range(8)), cache_salt=None, lora_request=None, mm_features=None
        )
        return ExampleConnector(cfg, KVConnectorRole.WORKER)._keys(req)

    with tempfile.TemporaryDirectory() as d:
        assert keys("auto", d) == keys("float32", d)  # the same layout: the same keys
        assert keys("auto", d) != keys("bfloat16", d)
