"""Offline throughput: minivllm vs transformers' batched `generate`, side by side in one run.

Workload (fixed seed): N prompts of random token ids with lengths uniform in [min_len, max_len],
`output_len` new tokens each with EOS ignored, greedy. Same model, dtype and thread count for both.
Prints output tokens/s of each engine and the ratio, per dtype.

    python benchmarks/throughput.py                          # embedded SmolLM2, float32 + bfloat16
    python benchmarks/throughput.py --num-prompts 32 --dtype bfloat16
    python benchmarks/throughput.py --device cuda --model DIR --num-prompts 256 --min-len 100 --max-len 1024
"""
from __future__ import annotations

import argparse
import gc
import time

import torch


def make_workload(vocab_size: int, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    # Skip the first ids (often special tokens) so prompts are ordinary text tokens.
    return [torch.randint(100, vocab_size, (l,), generator=g).tolist() for l in lens]


def run_minivllm(model: str, prompts, output_len: int, dtype: str, device: str, args) -> float:
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams
    llm = LLM(model=model, dtype=dtype, device=device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == output_len * len(prompts), n_out
    del llm; gc.collect()
    return n_out / dt


def run_transformers(model: str, prompts, output_len: int, dtype: str, device: str, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(model, dtype=tdtype).to(device).eval()
    pad = m.config.pad_token_id if m.config.pad_token_id is not None else 0
    def batch(ps):
        L = max(map(len, ps))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps], device=device)  # left padding
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps], device=device)
        return ids, mask
    with torch.inference_mode():
        ids, mask = batch([prompts[0][:16]])
        m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        t = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), batch_size):
            ids, mask = batch(prompts[i:i + batch_size])
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        dt = time.perf_counter() - t
    del m; gc.collect()
    return n_out / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=64, help="transformers batch size (all prompts at once by default)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from minivllm.transformers_utils.embedded import resolve_model
    model = resolve_model(args.model)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts = make_workload(vocab, args.num_prompts, args.min_len, args.max_len, args.seed)
    print(f"model={model} prompts={len(prompts)} input_len=[{args.min_len},{args.max_len}] output_len={args.output_len} "
          f"threads={torch.get_num_threads()} device={args.device}")
    print(f"{'dtype':<10}{'minivllm tok/s':>16}{'transformers tok/s':>20}{'ratio':>8}")
    for dtype in args.dtype:
        ours = run_minivllm(model, prompts, args.output_len, dtype, args.device, args)
        hf = float("nan") if args.skip_hf else run_transformers(model, prompts, args.output_len, dtype, args.device, args.hf_batch_size)
        print(f"{dtype:<10}{ours:>16.1f}{hf:>20.1f}{ours / hf:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
