#!/usr/bin/env bash
# GPU validation of the Triton kernels, the Triton attention backend and CUDA graphs (issue 5, items 5-6).
#
# Two steps, because the device machine cannot reach PyPI:
#   1. here (with PyPI):      tools/gpu_validate.sh prepare
#      downloads the few runtime wheels the device image lacks (msgspec, cbor2, pyzmq) into .whl/ (git-ignored).
#   2. on the device machine: tools/gpu_validate.sh        (device `run`, carry [".whl"], timeout_s 480)
#      installs them to /tmp/site, then runs tests/test_triton_attention.py (its GPU tests: kernels in
#      fp32/fp16/bf16 vs the torch reference; tiny Qwen3/Llama greedy with the Triton backend and with
#      FULL_DECODE_ONLY / FULL CUDA graphs equal to the torch reference, graphs replayed) and
#      benchmarks/kernels.py. Logs go to $OUT (or ./gpu_validate_logs). About 3-5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl
  PIP=${PIP:-.venv/bin/pip}
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec cbor2 pyzmq
  ls .whl
  exit 0
fi
LOG=${OUT:-gpu_validate_logs}
mkdir -p "$LOG"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 MINIVLLM_ENABLE_V1_MULTIPROCESSING=0
python3 - <<'PY' 2>&1 | tee "$LOG/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
PY
rc=0
timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_attention.py -rs 2>&1 | tee "$LOG/tests.txt" || rc=1
timeout 120 python3 benchmarks/kernels.py --iters 20 2>&1 | tee "$LOG/bench_kernels.txt" || rc=1
echo "gpu_validate: rc=$rc" | tee -a "$LOG/tests.txt"
exit $rc
