#!/usr/bin/env bash
# On the H200, from the repository root, after the wheels of gpu.sh are installed and
# PYTHONPATH is set: every book notebook under nbval, with live GPU cells.
set -uo pipefail
python3 -m pytest -q -n "${NB_WORKERS:-4}" --dist loadfile -p no:cacheprovider --nbval-lax --nbval-current-env \
  --nbval-sanitize-with book/sanitize.cfg "$@" book
