"""Speculative decoding across processes (issue 33): the engine core in its own process, the model in worker
processes (the mp executor), tensor parallelism 2. The drafts travel in ModelRunnerOutput.spec_token_ids from
the output rank, the SchedulerOutput with scheduled_spec_decode_tokens to every rank; every rank proposes the
same n-gram drafts from the same tokens. Greedy tokens must equal those without speculation."""
import random

import pytest

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint


@pytest.mark.parametrize("tp", [1, 2])
def test_ngram_over_processes(tmp_path, monkeypatch, tp):
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(10)]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": base[:4] * 5}]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    results = []
    for kw in ({}, {"speculative_config": spec}):
        llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                  distributed_executor_backend="mp", tensor_parallel_size=tp, **kw)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1]
