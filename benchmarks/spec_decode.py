"""Speculative decoding: single-stream tok/s with and without drafts, in one run (issue 33).

One request at a time (a single stream: what speculation is for), greedy, on the embedded SmolLM2-135M-Instruct
(or `--model`), float32 by default. Workloads, each a list of chat prompts:

- `code`: rewrite a given code block with one name changed (the answer copies most of the prompt);
- `quote`: summarise a passage with quotations from it;
- `chat`: free chat (little to copy: the proposer mostly finds nothing and backs off).

For each workload: tok/s without speculation, then with each `--speculative-config` given (default: n-gram
with k = 3 and 5, prompt_lookup 2..4), the greedy tokens compared token for token with the run without
(a mismatch is reported and makes the exit status 1), the speed-up, the draft acceptance rate and the
acceptance per position (from the scheduler's SpecDecodingStats). Each prompt is generated once untimed first
(prefix cache, CPU GEMM choice, graphs), then `--repeats` times timed; the median is reported.

    python benchmarks/spec_decode.py                                # all workloads, 128 tokens
    python benchmarks/spec_decode.py --workloads code --max-tokens 64 --repeats 1
    python benchmarks/spec_decode.py --spec '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler's stats are read in-process

from minivllm.entrypoints.llm import LLM  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402

CODE = '''def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. \"The lamp must never go out,\" "
    "his father had told him, \"because somewhere out there a ship is counting on it.\" For forty years he "
    "kept that promise, through storms that shook the glass and winters that froze the oil. When the "
    "automatic beacon was finally installed, he said only, \"Then the light will outlive me, as it should.\""
)
WORKLOADS = {
    "code": [
        f"Rewrite this Python function, renaming the variable `result` to `merged`. Output only the code.\n\n{CODE}",
        f"Rewrite this Python function with the parameter `left` renamed to `first`. Output only the code.\n\n{CODE}",
    ],
    "quote": [
        f"Summarise this passage in three sentences, quoting the keeper's words exactly.\n\n{PASSAGE}",
    ],
    "chat": [
        "What are three good habits for staying healthy during winter?",
        "Explain in simple words why the sky is blue.",
    ],
}
DEFAULT_SPECS = [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
]


class SpecStatsTap:
    "Sums the scheduler's SpecDecodingStats while installed."

    def __init__(self, llm):
        self.reset()
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        make_stats = sched.make_stats

        def tapped():
            s = make_stats()
            sds = s.spec_decoding_stats if s is not None else None
            if sds is not None:
                self.drafts += sds.num_drafts
                self.draft_tokens += sds.num_draft_tokens
                self.accepted += sds.num_accepted_tokens
                if len(self.per_pos) < len(sds.num_accepted_tokens_per_pos):
                    self.per_pos += [0] * (len(sds.num_accepted_tokens_per_pos) - len(self.per_pos))
                for i, n in enumerate(sds.num_accepted_tokens_per_pos):
                    self.per_pos[i] += n
            return s

        sched.make_stats = tapped

    def reset(self):
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = []


def chat_prompt(llm, text):
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(chat, add_special_tokens=False).input_ids


def run_one(llm, prompt_ids, max_tokens, repeats):
    "(median tok/s, tokens) of one prompt, single stream."
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)  # untimed warm-up
    tokens = out[0].outputs[0].token_ids
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        rates.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
    return statistics.median(rates), tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="code,quote,chat")
    ap.add_argument("--spec", action="append", help="a --speculative-config JSON (repeatable)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    specs = [json.loads(s) for s in args.spec] if args.spec else DEFAULT_SPECS
    names = args.workloads.split(",")
    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048, disable_log_stats=False)
    engines = [("no speculation", LLM(**common))]
    engines += [(json.dumps(s), LLM(**common, speculative_config=s)) for s in specs]
    taps = [None] + [SpecStatsTap(llm) for _, llm in engines[1:]]
    results, mismatches = [], 0
    for name in names:
        prompts = [chat_prompt(engines[0][1], p) for p in WORKLOADS[name]]
        base_rates, base_tokens = zip(*(run_one(engines[0][1], p, args.max_tokens, args.repeats) for p in prompts))
        base = statistics.mean(base_rates)
        print(f"\n[{name}] no speculation: {base:.1f} tok/s")
        results.append({"workload": name, "spec": None, "tok_s": base})
        for (label, llm), tap in zip(engines[1:], taps[1:]):
            tap.reset()
            rates, tokens = zip(*(run_one(llm, p, args.max_tokens, args.repeats) for p in prompts))
            same = list(tokens) == list(base_tokens)
            mismatches += not same
            rate = statistics.mean(rates)
            acc = tap.accepted / tap.draft_tokens if tap.draft_tokens else 0.0
            per_pos = [round(n / tap.drafts, 3) for n in tap.per_pos] if tap.drafts else []
            print(
                f"[{name}] {label}: {rate:.1f} tok/s = {rate / base:.2f}x, tokens identical: {same}, "
                f"acceptance {acc:.1%}, per position {per_pos}, mean tokens per draft step "
                f"{1 + tap.accepted / max(tap.drafts, 1):.2f}"
            )
            results.append(
                {"workload": name, "spec": label, "tok_s": rate, "speedup": rate / base, "identical": same,
                 "acceptance": acc, "acceptance_per_pos": per_pos}
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
