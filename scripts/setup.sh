#!/usr/bin/env bash
# Create ./.venv (if missing) with the pinned CPU stack and this plugin installed (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.llamafactory_liger_fsdp_deps
want=$(cat requirements-cpu.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-cpu.txt
  .venv/bin/python -m pip install -q -e .
  echo "$want" > "$stamp"
fi
# the .pth hook must have run at interpreter start (importing _bootstrap here would install it and prove nothing)
.venv/bin/python -c "import sys; b = sys.modules.get('llamafactory_liger_fsdp._bootstrap'); assert b is not None and b.ACTIVE, 'import hook not active: the .pth file did not run'"
