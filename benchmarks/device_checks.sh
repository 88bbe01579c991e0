#!/usr/bin/env bash
# The prepared check for a lent NVIDIA machine (issue 44's GPU figures and the MXFP8 kernels), meant for ONE
# call of the device tool from the repository root:
#
#     run(command="bash benchmarks/device_checks.sh", timeout_s=540)
#
# It needs only what that machine's image holds (python3 with torch, triton, transformers, safetensors,
# tokenizers, numpy): the two benchmarks import no Django, Ray or web dependency. Each figure goes to
# $OUT/<name>.txt (the device tool brings $OUT back). Not run on a GPU yet: no device has been lent to the
# tasks that wrote it, so its timeouts are estimates (the GPU path of bench_gpu_rl builds, saves and imports
# a ~1.1B-parameter random Qwen3-MoE before its update).
#
# What it does NOT check: the Ray actors on CUDA (tests/training/test_learner_gpus.py's CUDA test). That
# needs Ray there, and Ray's cp312 wheel (79 MB) is over the tool's 64 MiB carry limit; see
# docs/notebook/2026-12-02c-issue-50-44.md for the ways round it.
set -u
OUT=${OUT:-/tmp/device-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

status=0
timeout 300 "$PY" benchmarks/bench_gpu_rl.py 2>&1 | tee "$OUT/bench_gpu_rl.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 180 "$PY" benchmarks/bench_kernels_gpu.py 2>&1 | tee "$OUT/bench_kernels_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "device_checks: exit $status" | tee -a "$OUT/machine.txt"
exit $status
