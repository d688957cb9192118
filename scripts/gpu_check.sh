#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the device tool's `run`), under 8 minutes:
# build, the CUDA tests, the GPU training benchmark, logs / JSON / PNG under $OUT, and a
# short summary printed last. Nothing can be fetched there: it uses that machine's python3
# (torch with CUDA, nanobind, scikit-build-core, pytest, transformers; DeepSpeed and torchao
# are used where they import) and builds without isolation or dependencies.
#
#   bash scripts/gpu_check.sh                     # OUT defaults to ./gpu-out
#   DEVICE=cpu SKIP_BUILD=1 bash scripts/gpu_check.sh   # the same steps on a CPU, tiny sizes
#                                                       # (tests/bench/test_gpu_check_script.py)
#
# Every part runs under its own time limit and a failing part does not stop the rest: the
# summary says how each ended. Time limits (seconds): BUILD_S, TESTS_S, BENCH_S, CAP_S.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
# limits add up to 8 minutes with the probe's 40 s; the bench and capacity parts end their runs in time
BUILD_S=${BUILD_S:-140}; TESTS_S=${TESTS_S:-80}; BENCH_S=${BENCH_S:-130}; CAP_S=${CAP_S:-90}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SUMMARY="$OUT/summary.txt"; : > "$SUMMARY"
started=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...: run it with its output in $OUT/NAME.log; note how it ended
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) rc
  echo "== $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  tail -n 25 "$OUT/$name.log"
  local how="ok"; [ $rc -eq 124 ] || [ $rc -eq 137 ] && how="TIMED OUT"; [ $rc -ne 0 ] && [ "$how" = ok ] && how="FAILED (exit $rc)"
  echo "$name: $how in $(( $(date +%s) - t0 )) s (log: $OUT/$name.log)" | tee -a "$SUMMARY"
  return $rc
}

{
  nvidia-smi || echo "nvidia-smi: not here"
  $PY - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib, platform, os
print("python", platform.python_version(), "cores", os.cpu_count())
for name in ("torch", "transformers", "deepspeed", "torchao", "nanobind", "scikit_build_core", "pytest", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "absent:", type(exc).__name__, exc)
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
  if [ "${SKIP_BUILD:-0}" != "1" ]; then
    part build "$BUILD_S" $PY -m pip install -v --no-build-isolation --no-deps .
  fi
  part native "$TESTS_S" $PY -c "import tierstate.kernels as k; print(k.backend_info())"
  # the CUDA tests (and the page-locked buffers' test, whose CUDA half runs there)
  part cuda_tests "$TESTS_S" $PY -m pytest -q -p no:cacheprovider tests/cuda tests/io/test_page_locked.py --junitxml="$OUT/cuda_tests.xml"
  # the hardware profile offload="auto" plans from (PCIe, host and disk rates), for the runs below
  mkdir -p "$OUT/nvme"; export TIERSTATE_PROFILE="$OUT/hardware.json"
  part probe 40 $PY -m tierstate probe --nvme-dir "$OUT/nvme" --out "$TIERSTATE_PROFILE"
  if [ "$DEVICE" = cpu ]; then
    part bench "$BENCH_S" $PY -m tierstate bench gpu --device cpu --sizes tiny --modes torch,cpu,nvme,deepspeed \
      --batch 2 --seq 32 --steps 2 --warmup 1 --out-dir "$OUT/bench" --json "$OUT/bench.json" --nvme-dir "$OUT/nvme"
  else
    # speed where plain torch fits (8k tokens a step), against DeepSpeed and torchao where present
    part bench "$BENCH_S" $PY -m tierstate bench gpu --sizes 1b,3b --modes torch,cpu,cpu_bwd,deepspeed,torchao,auto \
      --batch 8 --seq 1024 --steps 3 --warmup 1 --timeout 100 --budget $(( BENCH_S - 15 )) \
      --out-dir "$OUT/bench" --json "$OUT/bench.json" --nvme-dir "$OUT/nvme"
    # capacity as on a 24 GB card: does 7B train with the state on the host where plain torch
    # stops at 1B (7B fp32 does not even load under the cap, so its refusal takes seconds)?
    part capacity "$CAP_S" $PY -m tierstate bench gpu --caps 24 --largest --sizes 1b,7b --modes torch,cpu \
      --batch 1 --seq 1024 --steps 2 --warmup 1 --timeout 90 --budget $(( CAP_S - 15 )) \
      --out-dir "$OUT/capacity" --json "$OUT/capacity.json" --nvme-dir "$OUT/nvme"
  fi
  rm -rf "$OUT/nvme"
  echo
  echo "== summary ($(( $(date +%s) - started )) s in all)"
  cat "$SUMMARY"
  for f in "$OUT/bench.log" "$OUT/capacity.log"; do
    [ -f "$f" ] && { sed -n '/^| cap GiB/,$p' "$f" | grep -v '^| ---' | grep -E "^\|.*\| ok \||target|largest|CPU run" | tail -n 20 || true; }
  done
  grep -E "passed|failed|error|skipped" "$OUT/cuda_tests.log" | tail -n 1 || true
} 2>&1 | tee "$OUT/gpu_check.log"
exit 0  # how each part ended is in the summary above; a failed part is not a failed check run
