#!/usr/bin/env bash
# Install everything, then run the whole test suite (CPU; real 2-process FSDP, real llamafactory-cli runs,
# the Triton kernel under TRITON_INTERPRET=1) on the pinned stack of requirements-cpu.txt (the GPU image's torch 2.11 /
# triton 3.6), then, with no arguments, on the stacks users install today (scripts/test_stacks.sh: PyPI's
# llamafactory 0.9.5 with torch 2.15 / triton 3.9, and LLaMA-Factory git main from source). `.ci/run` calls this.
#
#   bash scripts/test.sh                  # everything (CI)
#   bash scripts/test.sh -m "not slow"    # with pytest arguments: the pinned stack only (the fast tier here)
#   STACKS=none bash scripts/test.sh      # the pinned stack's whole suite only
#
# Two pytest workers, each taking whole test files (module fixtures are built once); pass `-n 0` for one process.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
STACKS=${STACKS:-$([ $# -eq 0 ] && echo all || echo none)}
t0=$SECONDS
if [ "$STACKS" != none ]; then  # the stacks' venvs (mostly downloads) are built while the pinned tests run, at the
  # lowest CPU and disk priority: the pinned tests' launches keep the 2 cores, the downloads and unpacking take the gaps
  idle=$(ionice -c 3 true 2>/dev/null && echo "ionice -c 3")
  nice -n 19 $idle bash scripts/test_stacks.sh prepare > .venv/stacks_prepare.log 2>&1 &
  prepare=$!
fi
# DeepSpeed's JIT-built ops (its CPU shm collective) per venv: one shared cache would be rebuilt whenever the stacks'
# torch and this one take turns
(export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions"
 exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 tests "$@")
rc=$?
echo "test.sh: pinned stack: exit $rc in $((SECONDS - t0)) s"
if [ "$STACKS" != none ]; then
  wait "$prepare" || { echo "test.sh: building the stacks' venvs failed (retried below):"; tail -20 .venv/stacks_prepare.log; }
  bash scripts/test_stacks.sh "$STACKS" || rc=1
fi
exit $rc
