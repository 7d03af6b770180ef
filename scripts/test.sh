#!/usr/bin/env bash
# Install everything, then run the whole test suite (CPU; real 2-process FSDP, real llamafactory-cli runs,
# the Triton kernel under TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q tests "$@"
