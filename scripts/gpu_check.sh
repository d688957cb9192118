#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the device tool's `run`): build, run the
# CUDA tests and a GPU demo, leave logs under $OUT. Nothing can be fetched there: it uses
# that machine's python3, which already holds torch (CUDA), nanobind, scikit-build-core,
# pytest, transformers and lightning, and builds without isolation or dependencies.
#   run: bash scripts/gpu_check.sh        (OUT defaults to ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi || true
  python3 -m pip install -q --no-build-isolation --no-deps . || exit 1
  python3 -c "import torch, tierstate.kernels as k; print(torch.__version__, torch.cuda.get_device_name(0), k.backend_info())"
  python3 -m pytest -q -x tests/cuda tests/optim tests/pipeline tests/tiers tests/weights  # src/ layout: runs from the root
  python3 -m tierstate probe --quick --out "$OUT/hardware.json"
  python3 -m tierstate demo --device cuda --model small --steps 50 --dtype bf16 --json "$OUT/demo.json"
} 2>&1 | tee "$OUT/gpu_check.log"
