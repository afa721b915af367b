#!/usr/bin/env bash
# GPU validation of the Triton kernels, the Triton attention backend and CUDA graphs (issue 5, items 5-6),
# plus the throughput benchmark with CUDA graphs off and on.
#
# Two steps, because the device machine cannot reach PyPI:
#   1. here (with PyPI):      tools/gpu_validate.sh prepare
#      downloads the few runtime wheels the device image lacks (msgspec, cbor2, pyzmq, fastcore) into .whl/ (git-ignored).
#   2. on the device machine: tools/gpu_validate.sh        (device `run`, carry [".whl"], timeout_s 480)
#      installs them to /tmp/site, then, each step under its own timeout so one slow step cannot eat the others:
#        a. tests (<= 270 s): tests/test_triton_attention.py (kernels in fp32/fp16/bf16 vs the torch reference;
#           tiny Qwen3/Llama/Gemma3 greedy with the Triton backend and FULL_DECODE_ONLY / FULL graphs equal to the
#           torch reference) and tests/test_cudagraph_runner.py (its GPU test: FULL, PIECEWISE and
#           FULL_AND_PIECEWISE graphs, Triton and torch-reference attention, equal to eager and the reference);
#           tests/test_lora_triton.py (<= 90 s: the LoRA shrink/expand kernels and a mixed-adapter batch on CUDA);
#        b. benchmarks/attention_kernels.py (<= 60 s);
#        c. benchmarks/throughput.py (<= 150 s) on a random-weight Qwen3-0.6B-shaped checkpoint (bf16), eager
#           (--enforce-eager) then FULL_AND_PIECEWISE, nano-vllm's workload shape (input and output lengths
#           uniform in 100..1024) but THROUGHPUT_PROMPTS=128 prompts instead of nano-vllm's 256 to fit the
#           8-minute budget (the step count is set by the longest output, ~1024 decode steps either way).
#      Logs go to $OUT (or ./gpu_validate_logs): env.txt, tests.txt, bench_kernels.txt, throughput.txt/.json.
#      Budget: about 20 s set-up + 270 + 60 + 150 s at most, under 8 minutes.
#   CPU dry run of the non-GPU parts: GPU_VALIDATE_DRY_RUN=1 tools/gpu_validate.sh (the GPU tests skip, the
#   benchmarks run on a tiny setting on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl
  PIP=${PIP:-.venv/bin/pip}
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec cbor2 pyzmq fastcore==1.8.18
  ls .whl
  exit 0
fi
LOG=${OUT:-gpu_validate_logs}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
[ -n "${GPU_VALIDATE_DRY_RUN:-}" ] && PY=${PYTHON:-.venv/bin/python}
if [ -z "${GPU_VALIDATE_DRY_RUN:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 MINIVLLM_ENABLE_V1_MULTIPROCESSING=0
$PY - <<'PY' 2>&1 | tee "$LOG/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
PY
rc=0
if [ -n "${GPU_VALIDATE_DRY_RUN:-}" ]; then  # here, on the CPU: only check that every step starts and ends
  timeout 300 $PY -m pytest -q -x -p no:cacheprovider tests/test_cudagraph_runner.py -k gpu -rs 2>&1 | tee "$LOG/tests.txt" || rc=1
  timeout 600 $PY benchmarks/throughput.py --random-weights qwen3-0.6b --skip-hf --num-prompts 2 --max-len 16 \
    --output-len 4 --enforce-eager --cudagraph-mode FULL_AND_PIECEWISE --output-json "$LOG/throughput.json" \
    2>&1 | tee "$LOG/throughput.txt" || rc=1
  $PY benchmarks/attention_kernels.py --help >/dev/null || rc=1
  echo "gpu_validate (dry run): rc=$rc" | tee -a "$LOG/tests.txt"
  exit $rc
fi
timeout 270 $PY -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_cudagraph_runner.py -rs \
  2>&1 | tee "$LOG/tests.txt" || rc=1
# P/D over the P2P connector with the engine's cache on the GPU: the producer's answer copies device slices to
# the host (a .numpy() of a CUDA tensor raised before), the consumer writes them back to the device
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_kv_connector_pd.py -k "equal_one_instance or device_cache" \
  -rs 2>&1 | tee "$LOG/tests_pd.txt" || rc=1
# speculative decoding (issue 33) on the GPU: the rejection sampler and the drafts' tensors on the device,
# greedy tokens with ngram and draft-model drafts equal to transformers' (float32)
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_spec_decode.py tests/test_spec_decode_sampler.py \
  -k "ngram_greedy or own_draft or draft_model_greedy or distribution" -rs 2>&1 | tee "$LOG/tests_spec_decode.txt" || rc=1
# multi-LoRA (issue 32): the Triton shrink/expand kernels (minivllm_kernels/lora_ops.py) in fp32/fp16/bf16 against the
# torch reference on the device, and a tiny Llama with three adapters and the base model in one batch on CUDA
# (the Triton kernels, the CUDA default) giving the torch reference kernel's greedy tokens
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_lora_triton.py -rs 2>&1 | tee "$LOG/tests_lora.txt" || rc=1
timeout 60 $PY benchmarks/attention_kernels.py --iters 20 2>&1 | tee "$LOG/bench_kernels.txt" || rc=1
timeout 150 $PY benchmarks/throughput.py --device cuda --random-weights qwen3-0.6b --skip-hf \
  --num-prompts "${THROUGHPUT_PROMPTS:-128}" --min-len 100 --max-len 1024 --min-output-len 100 --max-output-len 1024 \
  --max-num-seqs 512 --max-num-batched-tokens 8192 --enforce-eager --cudagraph-mode FULL_AND_PIECEWISE \
  --output-json "$LOG/throughput.json" 2>&1 | tee "$LOG/throughput.txt" || rc=1
echo "gpu_validate: rc=$rc" | tee -a "$LOG/tests.txt"
exit $rc
