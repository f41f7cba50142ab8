#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, with `.whl` carried:
#   bash ecekern/captures/gpu.sh [--quick] [chapters...]
# installs the carried wheels, runs the GPU tests, then the captures; everything
# that should come back is written under $OUT (captures as one archive).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 ECEKERN_COMMIT=${ECEKERN_COMMIT:-unknown}
quick=""
if [ "${1:-}" = "--quick" ]; then quick="--quick"; shift; fi
chapters=${*:-methodology 01_einsum_reference}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
# the tests compile many kernel variants on first use: bound them so captures still run
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings \
  --durations=10 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
python3 -m ecekern.captures $chapters --out /tmp/caps $quick 2>&1 | tee "$OUT/captures.log"
cp /tmp/caps/captures.tar.gz "$OUT/"
