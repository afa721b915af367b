"""Encoder-cache transfer (ECExampleConnector) through the whole engine, on the tiny Gemma 3 vision checkpoint
(float32, CPU).

An encoder-only producer (`ec_role` "ec_producer") and a consumer sharing a folder give the same greedy tokens
as one plain instance; the consumer never runs the vision tower; the producer never runs the decoder and takes
no KV block. A file that is missing, or damaged after the producer wrote it (garbage, one bit flipped: files
carry a checksum), is encoded on the consumer instead: same tokens, a warning, no hang; a damaged file is
deleted.
"""

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
pytestmark = pytest.mark.timeout(120)  # a load that never completes must fail the test, not hang it


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


def request(*seeds: int) -> dict:
    prompt = "<bos>Look" + "".join(f" at <start_of_image> number {i}" for i in range(len(seeds))) + " and say"
    return {"prompt": prompt, "multi_modal_data": {"image": [image(s) for s in seeds]}}


def tokens(llm, requests) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY, use_tqdm=False)]


def core(llm):
    return llm.llm_engine.engine_core.engine_core


def runner(llm):
    return core(llm).model_executor.driver_worker.model_runner


def ec_config(folder, role: str) -> dict:
    return {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(folder)},
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gemma3_mm", tmp_path_factory.mktemp("g3mm"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ec_store")


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(ckpt, dtype="float32", block_size=4)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def producer(ckpt, folder):
    llm = LLM(ckpt, dtype="float32", block_size=4, ec_transfer_config=ec_config(folder, "ec_producer"))
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def consumer(ckpt, folder):
    llm = LLM(ckpt, dtype="float32", block_size=4, ec_transfer_config=ec_config(folder, "ec_consumer"))
    yield llm
    llm.llm_engine.shutdown()


PRODUCED = [(0,), (1, 2), (3,), (4, 5)]  # the images the producer encodes, one request each


@pytest.fixture(scope="module")
def produced(producer, folder):
    """Run the producer over PRODUCED, one request at a time: (outputs, the folders each request added, the
    decoder calls and the KV blocks taken meanwhile)."""
    r, pool = runner(producer), core(producer).scheduler.kv_cache_manager.block_pool
    calls = {"forward": 0, "blocks": 0}
    forward, get_new_blocks = r.model.forward, pool.get_new_blocks

    def counting_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def counting_blocks(n):
        calls["blocks"] += n
        return get_new_blocks(n)

    r.model.forward, pool.get_new_blocks = counting_forward, counting_blocks
    outputs, folders = [], {}
    try:
        for seeds in PRODUCED:
            before = {p.name for p in folder.iterdir()}
            outputs += producer.generate([request(*seeds)], GREEDY, use_tqdm=False)
            folders[seeds] = sorted({p.name for p in folder.iterdir()} - before)
    finally:
        r.model.forward, pool.get_new_blocks = forward, get_new_blocks
    return outputs, folders, calls


def test_producer_encodes_saves_and_never_decodes(producer, produced, folder):
    outputs, folders, calls = produced
    # one placeholder token per request, finished there (max_tokens was 6)
    assert [o.outputs[0].token_ids for o in outputs] == [[0]] * len(PRODUCED)
    assert {o.outputs[0].finish_reason for o in outputs} == {"length"}
    assert [len(folders[s]) for s in PRODUCED] == [len(s) for s in PRODUCED]  # one file per new image
    for name in sum(folders.values(), []):
        assert (folder / name / "encoder_cache.safetensors").is_file()
    assert runner(producer).num_encoder_runs == len(PRODUCED)  # the vision tower ran, once per request
    assert calls["forward"] == 0  # the decoder never ran
    # no KV cache at all: no group, no tensor, no block ever handed out
    scheduler = core(producer).scheduler
    assert scheduler.kv_cache_config.kv_cache_groups == [] and runner(producer).kv_caches == []
    assert calls["blocks"] == 0 and scheduler.kv_cache_manager.block_pool.get_usage() == 0.0
    # an image already in the folder is not encoded again
    runs = runner(producer).num_encoder_runs
    assert tokens(producer, [request(3)]) == [[0]] and runner(producer).num_encoder_runs == runs


def test_consumer_equals_one_instance_without_the_encoder(plain, consumer, produced):
    requests = [request(0), request(1, 2), request(3), request(2, 0)]  # the last reuses stored images
    expected = tokens(plain, requests)
    before = runner(consumer).num_encoder_runs
    assert tokens(consumer, requests) == expected
    assert runner(consumer).num_encoder_runs == before == 0  # every image came from the folder
    assert runner(plain).num_encoder_runs > 0


def test_damaged_files_are_encoded_on_the_consumer(plain, consumer, produced, folder, caplog):
    garbage, short = (folder / name / "encoder_cache.safetensors" for name in produced[1][(4, 5)])
    garbage.write_bytes(b"\0" * 64)  # unreadable
    from safetensors.torch import save_file

    from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import safetensors_digest

    # readable and intact, the right 4 rows but the width of another checkpoint (a rebuilt model at the same
    # path keeps its image hashes): a first version checked only the rows and the merge then killed the engine
    other = {"ec_cache": torch.zeros(4, 8)}
    save_file(other, str(short), metadata={"sha256": safetensors_digest(other)})
    expected = tokens(plain, [request(4, 5)])
    before = runner(consumer).num_encoder_runs
    with caplog.at_level(logging.WARNING):
        assert tokens(consumer, [request(4, 5)]) == expected
    assert runner(consumer).num_encoder_runs == before + 1  # both images encoded, in one batch
    assert caplog.text.count("cannot load encoder output") == 2
    assert "did not come through the EC connector" in caplog.text
    assert not garbage.exists() and short.exists()  # the damaged file deleted, the intact one kept


def test_a_flipped_bit_is_encoded_and_deleted(plain, producer, consumer, folder):
    """Issue 30: a stored output with one bit flipped (a valid safetensors file of the right shape) was loaded
    as an embedding the encoder never produced. Files carry a sha256: this one is encoded and deleted."""
    before = {p.name for p in folder.iterdir()}
    producer.generate([request(8)], GREEDY, use_tqdm=False)
    (name,) = {p.name for p in folder.iterdir()} - before
    stored = folder / name / "encoder_cache.safetensors"
    raw = bytearray(stored.read_bytes())
    raw[-3] ^= 0x10  # one bit of the last embedding row
    stored.write_bytes(bytes(raw))
    expected = tokens(plain, [request(8)])
    runs = runner(consumer).num_encoder_runs
    assert tokens(consumer, [request(8)]) == expected
    assert runner(consumer).num_encoder_runs == runs + 1  # before: 0 runs, the flipped output was used
    assert not stored.exists()


def test_missing_file_is_encoded_on_the_consumer(plain, consumer, produced, caplog):
    expected = tokens(plain, [request(7)])  # an image the producer never saw
    before = runner(consumer).num_encoder_runs
    with caplog.at_level(logging.WARNING):
        assert tokens(consumer, [request(7)]) == expected
    assert runner(consumer).num_encoder_runs == before + 1
    assert "no encoder output for" in caplog.text


def test_ec_both_saves_then_loads(ckpt, plain, tmp_path):
    """`ec_both`: an engine on an empty folder encodes and saves (its tokens are the plain ones); a second
    one on the same folder loads instead of encoding."""
    requests = [request(10), request(11, 10)]
    expected = tokens(plain, requests)
    for n_runs in (1, 0):  # one batched encoder run (both requests in one step) for the first, none after
        llm = LLM(ckpt, dtype="float32", block_size=4, ec_transfer_config=ec_config(tmp_path, "ec_both"))
        try:
            assert tokens(llm, requests) == expected
            assert runner(llm).num_encoder_runs == n_runs
        finally:
            llm.llm_engine.shutdown()
    assert len(list(tmp_path.iterdir())) == 2


def test_cli_flags_reach_the_engine_config(ckpt):
    import argparse
    import json

    from minivllm.entrypoints.cli.main import _ENGINE_FLAGS, make_parser
    from minivllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser

    flag = json.dumps(ec_config("/tmp/unused", "ec_producer"))
    parser, _ = make_parser()
    for argv in (["generate", str(ckpt), "hi"], ["chat", str(ckpt)]):
        assert parser.parse_args([*argv, "--ec-transfer-config", flag]).ec_transfer_config == flag
    assert "ec_transfer_config" in _ENGINE_FLAGS
    serve_args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        [str(ckpt), "--ec-transfer-config", flag]
    )
    config = engine_args_from(serve_args).create_engine_config().ec_transfer_config
    assert config.is_ec_producer_only and config.ec_connector_extra_config == {
        "shared_storage_path": "/tmp/unused"
    }


def test_metadata_and_output_pickle():
    "What crosses to the workers and back survives pickling (the multiprocess executor pickles both)."
    import pickle

    from minivllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnectorMetadata,
        MMMeta,
    )
    from minivllm.v1.outputs import ECConnectorOutput

    meta = ECExampleConnectorMetadata([MMMeta("abc", 3)])
    assert pickle.loads(pickle.dumps(meta)) == meta
    out = ECConnectorOutput(finished_sending={"r1"})
    assert pickle.loads(pickle.dumps(out)) == out


def test_chunked_prefill_producer_and_consumer(ckpt, plain, tmp_path):
    """10 tokens per step: prompts are cut before each image, so the images are met (and saved, then loaded)
    in later steps of running requests. The producer answers only once a prompt is complete."""
    requests = [request(20, 21), request(22)]
    expected = tokens(plain, requests)
    engines = {}
    for role in ("ec_producer", "ec_consumer"):
        engines[role] = LLM(
            ckpt,
            dtype="float32",
            block_size=4,
            max_num_batched_tokens=10,
            ec_transfer_config=ec_config(tmp_path, role),
        )
    try:
        assert tokens(engines["ec_producer"], requests) == [[0], [0]]
        assert len(list(tmp_path.iterdir())) == 3
        scheduler = core(engines["ec_consumer"]).scheduler
        steps, schedule = [], scheduler.schedule
        scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        assert tokens(engines["ec_consumer"], requests) == expected
        assert runner(engines["ec_consumer"]).num_encoder_runs == 0
        # some image was loaded for a request already running (a later chunk of its prompt)
        assert any(s.ec_connector_metadata.mm_datas and not s.scheduled_new_reqs for s in steps)
    finally:
        for llm in engines.values():
            llm.llm_engine.shutdown()


def test_another_checkpoints_encoder_outputs_are_encoded_again(ckpt, plain, tmp_path):
    """Issue 30 (eighth break pass): stored encoder outputs were keyed by the image's hash alone, so another
    checkpoint of the same width (a new version deployed at the same path, another model on the same folder)
    merged them into its prompt, silently. Each file now names the checkpoint that encoded it; another's is a
    miss (encoded again, and left for the checkpoint it belongs to)."""
    other = make_tiny_checkpoint("gemma3_mm", tmp_path / "other", seed=1)
    requests = [request(20)]
    store = tmp_path / "store"
    llm = LLM(ckpt, dtype="float32", block_size=4, ec_transfer_config=ec_config(store, "ec_both"))
    try:
        assert tokens(llm, requests) == tokens(plain, requests)  # encodes and saves
    finally:
        llm.llm_engine.shutdown()
    ref = LLM(other, dtype="float32", block_size=4)
    try:
        want = tokens(ref, requests)
    finally:
        ref.llm_engine.shutdown()
    llm = LLM(other, dtype="float32", block_size=4, ec_transfer_config=ec_config(store, "ec_both"))
    try:
        assert tokens(llm, requests) == want  # was: the first checkpoint's encoder output, other tokens
        assert runner(llm).num_encoder_runs == 1  # encoded again, not loaded
    finally:
        llm.llm_engine.shutdown()


def test_an_encoder_only_instance_of_a_text_model_is_refused(tmp_path):
    """`ec_producer` on a model without a vision encoder has nothing to run: it started and answered every
    request with token 0. It is refused when the engine's config is built, naming `ec_transfer_config`."""
    text = make_tiny_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="ec_transfer_config: ec_role ec_producer .* LlamaForCausalLM has none"):
        LLM(text, dtype="float32", ec_transfer_config=ec_config(tmp_path / "ec", "ec_producer"))
    consumer = LLM(text, dtype="float32", ec_transfer_config=ec_config(tmp_path / "ec", "ec_consumer"))
    try:  # a consumer only decodes: harmless, still served
        out = consumer.generate("hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        consumer.llm_engine.shutdown()
