"""Offline throughput: minivllm (with and without CUDA graphs) vs transformers' batched `generate`, in one run.

Workload (fixed seed): N prompts of random token ids with lengths uniform in [min_len, max_len], output
lengths uniform in [min_output_len, max_output_len] (EOS ignored), greedy, no detokenization. Same model,
dtype and thread count for every engine. Prints output tokens/s per engine configuration and dtype, and
the ratio to the first minivllm configuration (and to transformers unless --skip-hf).

    python benchmarks/throughput.py                          # embedded SmolLM2, float32 + bfloat16
    python benchmarks/throughput.py --num-prompts 32 --dtype bfloat16
    # nano-vllm's workload on a Qwen3-0.6B-shaped random checkpoint, CUDA graphs off and on:
    python benchmarks/throughput.py --device cuda --random-weights qwen3-0.6b --skip-hf --num-prompts 256 \\
        --min-len 100 --max-len 1024 --min-output-len 100 --max-output-len 1024 \\
        --enforce-eager --cudagraph-mode FULL_AND_PIECEWISE
    # CPU smoke test of the same path (slow, but it must work):
    python benchmarks/throughput.py --random-weights qwen3-0.6b --skip-hf --num-prompts 2 --max-len 16 --output-len 4

--async-scheduling adds a run with async scheduling off and one with it on; --enforce-eager adds an eager run; each --custom-ops SPEC adds a run with `custom_ops=SPEC.split(",")` (e.g.
`--custom-ops none all`: the torch layers vs the fused CPU kernels); each --cudagraph-mode adds a run with that mode (on the CPU every run is
eager: graphs are CUDA-only). With neither, one run uses the engine's default (env MINIVLLM_CUDAGRAPH_MODE,
else NONE). Engine start-up time (weights, KV cache, graph capture) is printed but not counted.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Run from a checkout without installing: the repository root (minivllm/, minivllm_kernels/) comes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# Random-weight checkpoints with real models' shapes (throughput does not depend on the weights' values).
RANDOM_WEIGHT_PRESETS = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def make_random_checkpoint(preset: str, path: str | Path, seed: int = 0) -> str:
    """A Qwen3 checkpoint of `preset`'s shape with random bfloat16 weights (std 0.02, norms 1) in folder `path`.

    The tokenizer and generation config come from `minivllm.testing.make_tiny_checkpoint` (its byte-level BPE
    covers only 512 ids, so run with detokenize=False); config.json and model.safetensors are then replaced."""
    import transformers
    from safetensors.torch import save_file

    from minivllm.testing import make_tiny_checkpoint
    path = Path(path)
    make_tiny_checkpoint("qwen3", path)  # tokenizer files, generation_config.json (its tiny weights are overwritten)
    cfg = dict(RANDOM_WEIGHT_PRESETS[preset])
    transformers.Qwen3Config(**cfg, dtype="bfloat16").save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], H), "model.norm.weight": ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(q, H), p + "self_attn.k_proj.weight": rand(kv, H),
              p + "self_attn.v_proj.weight": rand(kv, H), p + "self_attn.o_proj.weight": rand(H, q),
              p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D),
              p + "mlp.gate_proj.weight": rand(I, H), p + "mlp.up_proj.weight": rand(I, H), p + "mlp.down_proj.weight": rand(H, I),
              p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H)}
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def make_workload(vocab_size: int, n: int, min_len: int, max_len: int, min_out: int, max_out: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    out_lens = torch.randint(min_out, max_out + 1, (n,), generator=g).tolist()
    # Skip the first ids (often special tokens) so prompts are ordinary text tokens.
    return [torch.randint(100, vocab_size, (l,), generator=g).tolist() for l in lens], out_lens


def run_minivllm(model: str, prompts, output_lens, dtype: str, device: str, args, engine_kwargs: dict) -> tuple[float, float]:
    "(output tokens/s, engine start-up seconds)."
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams
    t = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, device=device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              max_model_len=args.max_model_len or args.max_len + max(output_lens), **engine_kwargs)
    startup = time.perf_counter() - t
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(temperature=0, max_tokens=4, detokenize=False),
                 use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(output_lens), (n_out, sum(output_lens))
    del llm, outs
    gc.collect()
    if torch.cuda.is_available(): torch.cuda.empty_cache()
    return n_out / dt, startup


def run_transformers(model: str, prompts, output_lens, dtype: str, device: str, batch_size: int) -> float:
    "Output tokens/s of batched greedy `generate`; each batch runs to its longest output, only requested tokens count."
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
        for i in range(0, len(prompts), batch_size):
            ids, mask = batch(prompts[i:i + batch_size])
            n = max(output_lens[i:i + batch_size])
            m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t
    del m
    gc.collect()
    return sum(output_lens) / dt


def engine_configs(args) -> list[tuple[str, dict]]:
    "(label, extra LLM kwargs) per minivllm run, in order."
    runs = [("eager", {"enforce_eager": True})] if args.enforce_eager else []
    runs += [(m.upper(), {"compilation_config": {"cudagraph_mode": m.upper()}}) for m in args.cudagraph_mode or []]
    runs += [(f"custom_ops={spec}", {"compilation_config": {"custom_ops": spec.split(",")}}) for spec in args.custom_ops or []]
    if args.async_scheduling:  # side by side: the same engine with async scheduling off, then on
        runs += [("sync scheduling", {}), ("async scheduling", {"async_scheduling": True})]
    return runs or [("default", {})]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--random-weights", choices=sorted(RANDOM_WEIGHT_PRESETS), default=None,
                    help="benchmark a random-weight checkpoint of this shape, built in a temporary folder")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128, help="output length of every prompt (unless min/max given)")
    ap.add_argument("--min-output-len", type=int, default=None)
    ap.add_argument("--max-output-len", type=int, default=None)
    ap.add_argument("--dtype", nargs="+", default=None, help="default: float32 bfloat16 (bfloat16 with --random-weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=64, help="transformers batch size")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: max-len + the longest output")
    ap.add_argument("--cudagraph-mode", nargs="+", default=None,
                    help="one minivllm run per CUDA graph mode (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE)")
    ap.add_argument("--enforce-eager", action="store_true", help="add a minivllm run with enforce_eager=True")
    ap.add_argument("--custom-ops", nargs="+", default=None, metavar="SPEC",
                    help="one minivllm run per CompilationConfig.custom_ops setting, comma-separated "
                         "(e.g. --custom-ops none all, or none,+rms_norm): the fused CPU kernels off / on")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="add two minivllm runs: async scheduling off, then on (AsyncScheduler, two batches in flight)")
    ap.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    ap.add_argument("--output-json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    if args.model and args.random_weights: ap.error("--model and --random-weights exclude each other")
    min_out = args.min_output_len if args.min_output_len is not None else args.output_len
    max_out = args.max_output_len if args.max_output_len is not None else max(args.output_len, min_out)
    if not 1 <= min_out <= max_out: ap.error(f"output lengths must satisfy 1 <= min <= max; got {min_out}, {max_out}")
    args.min_len = min(args.min_len, args.max_len)  # e.g. a smoke test with only --max-len 16
    dtypes = args.dtype or (["bfloat16"] if args.random_weights else ["float32", "bfloat16"])

    tmp = tempfile.TemporaryDirectory(prefix="minivllm-random-") if args.random_weights else None
    if tmp is not None:
        t = time.perf_counter()
        model = make_random_checkpoint(args.random_weights, Path(tmp.name) / args.random_weights, seed=args.seed)
        print(f"built random-weight {args.random_weights} checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
    else:
        from minivllm.transformers_utils.embedded import resolve_model
        model = str(resolve_model(args.model))
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(vocab, args.num_prompts, args.min_len, args.max_len, min_out, max_out, args.seed)
    runs = engine_configs(args)
    print(f"model={args.random_weights or model} prompts={len(prompts)} input_len=[{args.min_len},{args.max_len}] "
          f"output_len=[{min_out},{max_out}] (total {sum(output_lens)} output tokens) threads={torch.get_num_threads()} "
          f"device={args.device}")
    print(f"{'dtype':<10}{'engine':<28}{'start-up s':>11}{'output tok/s':>14}{'vs first':>10}")
    results = []
    for dtype in dtypes:
        first = None
        for label, kw in runs:
            tps, startup = run_minivllm(model, prompts, output_lens, dtype, args.device, args, kw)
            first = first or tps
            results.append(dict(dtype=dtype, engine=f"minivllm {label}", startup_s=startup, output_tok_per_s=tps))
            print(f"{dtype:<10}{'minivllm ' + label:<28}{startup:>11.1f}{tps:>14.1f}{tps / first:>10.2f}", flush=True)
        if not args.skip_hf:
            hf = run_transformers(model, prompts, output_lens, dtype, args.device, args.hf_batch_size)
            results.append(dict(dtype=dtype, engine="transformers", startup_s=None, output_tok_per_s=hf))
            print(f"{dtype:<10}{'transformers':<28}{'':>11}{hf:>14.1f}{hf / first:>10.2f}", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    if tmp is not None: tmp.cleanup()


if __name__ == "__main__":
    main()
