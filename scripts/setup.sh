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
# the LlamaBoard browser test's headless Chromium and its driver (Debian packages; as root, or with sudo that asks
# no password): where they cannot be installed the test says why and skips, except in CI (.ci/run), where it fails
if { ! command -v chromium || ! command -v chromedriver; } >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=$([ "$(id -u)" = 0 ] && echo "" || { sudo -n true 2>/dev/null && echo "sudo -n"; } || echo none)
  if [ "$sudo" != none ]; then
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver; } \
      > .venv/apt_chromium.log 2>&1 || echo "setup.sh: installing chromium chromium-driver failed (.venv/apt_chromium.log)" >&2
  fi
fi
# the .pth hook must have run at interpreter start (importing _bootstrap here would install it and prove nothing)
.venv/bin/python -c "import sys; b = sys.modules.get('llamafactory_liger_fsdp._bootstrap'); assert b is not None and b.ACTIVE, 'import hook not active: the .pth file did not run'"
