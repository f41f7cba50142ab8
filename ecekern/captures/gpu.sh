#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, with `.whl` carried:
#   bash ecekern/captures/gpu.sh [--quick] [chapters...]
# installs the carried wheels (.whl; TorchSim's stack from .whlts and
# cuEquivariance, the peer of chapter 1, from .whl/cueq or .whlcq where carried:
# all of them together pass the 64 MiB carry limit), runs the GPU tests, then the
# captures; everything that should come back is written under $OUT (captures as one
# archive). Chapters by slug:
# methodology 01_reference 02_linear 05_zonal. Environment: PARTS (the chapters'
# --parts, e.g. PARTS=progress for chapter 1's progress table), TEST_TIMEOUT
# (seconds for the tests, 540: the whole suite, slow cases included, took over 330 s
# on the H200 at -n 8), TEST_WORKERS (8), RUN_TESTS=0 to skip them, TESTS (the
# pytest paths, default tests), CAPTURES=0 to skip the captures.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" .site
shopt -s nullglob
wheels=(.whl/*.whl .whlts/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site \
    "${wheels[@]}" || exit 1
fi
cueq=(.whl/cueq/*.whl .whlcq/*.whl)
if [ ${#cueq[@]} -gt 0 ]; then
  for ops in .whl/cueq/cueq-ops.tar.xz .whlcq/cueq-ops.tar.xz; do
    if [ -f "$ops" ]; then tar -xJf "$ops" -C .site; fi
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site \
    "${cueq[@]}" || echo "cuEquivariance not installed: its peer rows are skipped"
fi
shopt -u nullglob
export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 ECEKERN_COMMIT=${ECEKERN_COMMIT:-unknown}
quick=""
if [ "${1:-}" = "--quick" ]; then quick="--quick"; shift; fi
chapters=${*:-methodology 01_reference}
parts=()
if [ -n "${PARTS:-}" ]; then parts=(--parts "$PARTS"); fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
if [ "${RUN_TESTS:-1}" != 0 ]; then
  # the tests compile many kernel variants on first use: bound them so captures run
  # -v with xdist names each test as it ends: a failure is named even when the
  # timeout cuts the run short of pytest's summary
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -n "${TEST_WORKERS:-8}" -rs \
    -p no:cacheprovider -p no:warnings --durations=10 ${TESTS:-tests} 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
fi
if [ "${CAPTURES:-1}" = 0 ]; then exit 0; fi
# shellcheck disable=SC2086
python3 -m ecekern.captures $chapters --out /tmp/caps $quick "${parts[@]}" 2>&1 \
  | tee "$OUT/captures.log"
cp /tmp/caps/captures.tar.gz "$OUT/"
