#!/usr/bin/env bash
# Developer build of tierstate._native without pip: configures into BUILD_DIR
# (default build/dev) and copies the module into src/tierstate/ so that a checkout with src/ on
# PYTHONPATH imports it. Set TIERSTATE_NATIVE_PATH instead of copying when several
# people build from one tree at once.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build/dev}
PY=${PYTHON:-python}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build "$BUILD_DIR" -j 2
so=$(ls "$BUILD_DIR"/_native*.so | head -n 1)
if [ "${NO_COPY:-0}" != "1" ]; then cp "$so" src/tierstate/; fi
echo "$so"
