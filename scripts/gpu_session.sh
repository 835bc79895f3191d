#!/usr/bin/env bash
# All GPU work of a session in one run (DESIGN.md, "Recording on the GPU"): GPU tests, then
# `make record`, then pack results/, figures/ and the executed notebooks into $OUT.
#
# Usage on the lent GPU machine, from the repo root, with the wheels of .whl/ (scripts/fetch_device_wheels.sh)
# installed on PYTHONPATH:
#   CGUTILS_GIT_COMMIT=<sha> bash scripts/gpu_session.sh [smoke|full] [NOTEBOOK ...]
# `smoke` runs the GPU tests and a short benchmark only; `full` (default) records every notebook, or
# only the notebooks named (file stems) after it.
set -uo pipefail
what=${1:-full}
shift || true
out=${OUT:-build/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step environment
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -m cgutils env

step "GPU tests"
python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} tests 2>&1 | tee "$out/gpu_tests.log"

step "PyTorch's cuBLAS-workspace fault, its reproducer (docs/pytorch-cublas-workspace-fault.md)"
mkdir -p results/nvidia-h200/repro
{ python3 -m cgutils env; for v in compile compile_clear_before; do echo "=== $v bert"
  timeout 200 python3 docs/repro/cublas_workspace_fault.py $v bert 2>&1 | grep -v "^  warnings.warn\|TensorFloat32"; echo "rc=${PIPESTATUS[0]}"; done; } \
  > results/nvidia-h200/repro/cublas_workspace_fault.log 2>&1
tail -20 results/nvidia-h200/repro/cublas_workspace_fault.log

step "GraphRunner overhead and threads (benchmarks/runner_overhead.py)"
python3 benchmarks/runner_overhead.py --out "$out/runner_overhead.json" 2>&1 | tee "$out/runner_overhead.log"

step "find_divergence on seeded faults (benchmarks/divergence_faults.py)"
python3 benchmarks/divergence_faults.py --out "$out/divergence_faults.json" 2>&1 | tee "$out/divergence_faults.log"

if [ "$what" = smoke ]; then
  step "short benchmark"
  python3 -m cgutils bench --dtypes fp16 --budget 0.3 --out "$out/smoke" 2>&1 | tee "$out/smoke_bench.log"
  exit 0
fi

step "make record"
if [ $# -gt 0 ]; then
  # bounded, so that the pack step below always runs inside the device's per-command limit
  { timeout "${RECORD_TIMEOUT:-480}" python3 -m cgutils record --notebooks "$@"; python3 -m cgutils record --check; } 2>&1 | tee "$out/record.log"
elif command -v make >/dev/null; then
  make record PY=python3 2>&1 | tee "$out/record.log"
else
  { python3 -m cgutils record; python3 -m cgutils record --check; } 2>&1 | tee "$out/record.log"
fi

step "pack"
tar czf "$out/recorded.tar.gz" results figures build/notebooks build/live 2>/dev/null || tar czf "$out/recorded.tar.gz" results figures build/notebooks
ls -la "$out"
