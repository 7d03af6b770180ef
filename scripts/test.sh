#!/usr/bin/env bash
# Install everything, then run the whole test suite (CPU; real 2-process FSDP, real llamafactory-cli runs,
# the Triton kernel under TRITON_INTERPRET=1). Two pytest workers, each taking whole test files (module fixtures are
# built once); pass `-n 0` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile tests "$@"
