"""The rejection sampler's output distribution equals the target's (issue 33).

A vocabulary of 8, target logits with a temperature and a top-k, drafts drawn from a draft distribution far from
the target (or one-hot, as the n-gram proposer's). With N independent one-draft steps, the count of each first
output token is binomial(N, p_i): a bin more than 5 standard deviations off has probability < 6e-7, so these
tests fail only when the sampler is wrong. The second position is checked too (two drafts per step: the second
output token, given an accepted first draft, is again distributed as the target's next-position distribution).
"""
import numpy as np
import pytest
import torch

from minivllm.v1.sample.metadata import SamplingMetadata
from minivllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, compute_probs
from minivllm.v1.spec_decode.metadata import make_spec_decode_metadata

N = 40000
VOCAB = 8


def _md(n, temperature, top_k=None):
    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int64),
    )


def _z_max(counts, p, n):
    expected = n * p
    sd = (n * p * (1 - p)).sqrt()
    mask = p > 0
    assert counts[~mask].sum() == 0, "tokens outside the target's support"
    return float(((counts[mask] - expected[mask]) / sd[mask]).abs().max())


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 5)])
def test_first_token_distribution(one_hot, temperature, top_k):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 2.5, 0.3, -1.0, 2.0, 0.0, 1.2, -0.5])
    md = _md(N, temperature, top_k)
    p = compute_probs(logits.expand(1, VOCAB), [1], _md(1, temperature, top_k))[0].double()
    q = torch.tensor([0.3, 0.02, 0.2, 0.2, 0.03, 0.1, 0.1, 0.05])
    drafts = [3] * N if one_hot else torch.multinomial(q, N, replacement=True).tolist()
    spec = make_spec_decode_metadata([[d] for d in drafts], np.arange(2, 2 * N + 1, 2))
    draft_probs = None if one_hot else q.expand(N, VOCAB).clone()
    out = RejectionSampler()(spec, draft_probs, logits.expand(N, VOCAB).clone(), torch.zeros(N, 1, dtype=torch.long), md)
    counts = torch.bincount(out[:, 0], minlength=VOCAB).double()
    assert _z_max(counts, p, N) < 5


def test_second_position_distribution():
    "Two one-hot drafts per step; given the first was accepted, the second output is distributed as p2."
    torch.manual_seed(1)
    l1 = torch.tensor([0.0, 3.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0])  # draft 1 (token 1) accepted most of the time
    l2 = torch.tensor([0.5, 0.1, 1.5, -0.2, 0.9, 0.0, 0.3, 1.1])
    logits = torch.stack([l1, l2]).repeat(N, 1)
    spec = make_spec_decode_metadata([[1, 6]] * N, np.arange(3, 3 * N + 1, 3))
    bonus = torch.full((N, 1), 7, dtype=torch.long)
    out = RejectionSampler()(spec, None, logits, bonus, _md(N, 1.0))
    accepted_first = out[:, 0] == 1
    second = out[accepted_first, 1]
    n = int(accepted_first.sum())
    p2 = l2.softmax(-1).double()
    counts = torch.bincount(second, minlength=VOCAB).double()
    assert _z_max(counts, p2, n) < 5
    # the bonus token comes exactly when both drafts were accepted
    both = accepted_first & (out[:, 1] == 6)
    assert bool((out[both, 2] == 7).all()) and bool((out[~both, 2] == PLACEHOLDER_TOKEN_ID).all())


def test_a_wrong_sampler_fails_the_check():
    "Accepting every draft puts the draft token's whole mass on it: the check must see it."
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 2.5, 0.3, -1.0, 2.0, 0.0, 1.2, -0.5])
    p = logits.softmax(-1).double()
    counts = torch.zeros(VOCAB, dtype=torch.double)
    counts[3] = N  # what an always-accept sampler would output for one-hot drafts of token 3
    assert _z_max(counts, p, N) > 5


def test_greedy_rows_in_a_random_batch():
    "A greedy request next to random ones keeps exact greedy semantics."
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [3.0, 0.0, 0.0]])
    spec = make_spec_decode_metadata([[1, 1], [2]], np.array([3, 5]))
    md = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0]), all_greedy=False, all_random=False, top_p=None, top_k=None
    )
    out = RejectionSampler()(spec, None, logits, torch.tensor([[2], [0]]), md)
    assert out[0].tolist() == [1, 2, -1]  # draft 2 (token 1) is not the argmax (2): replaced by it


def test_engine_sampling_distribution_with_drafts(tmp_path):
    """End to end: tokens 2 and 3 of random sampling (temperature 0.8, top-k 6) come from steps that verify the
    target's own greedy drafts; their distribution must equal the one without speculation. Two independent
    samples of N = 1500 requests each (own seeds): per token, |c1 - c2| / sqrt(c1 + c2) is about standard
    normal under equal distributions, so a bin beyond 5 fails only when the sampler is wrong."""
    from collections import Counter

    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams
    from minivllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    prompt = {"prompt_token_ids": [7, 8, 9, 10, 11, 12, 13, 14]}
    n = 1500
    counts = []
    for spec in (None, {"model": path, "num_speculative_tokens": 2}):
        llm = LLM(path, dtype="float32", max_model_len=64, num_gpu_blocks_override=512, speculative_config=spec,
                  max_num_seqs=256)
        params = [SamplingParams(temperature=0.8, top_k=6, seed=s + (0 if spec is None else 10**6), max_tokens=3,
                                 ignore_eos=True) for s in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        toks = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == 3 for t in toks)
        counts.append((Counter(t[1] for t in toks), Counter(t[2] for t in toks)))
        if spec is not None:
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
            assert runner.num_spec_steps > 0
    for pos in (0, 1):
        a, b = counts[0][pos], counts[1][pos]
        z = max(abs(a[t] - b[t]) / (a[t] + b[t]) ** 0.5 for t in set(a) | set(b))
        assert z < 5, (pos, z)
        common = sum(min(a[t], b[t]) for t in set(a) | set(b)) / n
        assert common > 0.85  # the two histograms overlap almost entirely
