#!/usr/bin/env bash
# The fast test tier on what a plain `pip install llamafactory==0.9.5` brings today, not on the pinned stack of
# requirements-cpu.txt. Builds ./.venv-latest (if missing) the way a new user would: no torch/numpy/triton pins, pip
# resolves (seen 2026-12-04: torch 2.14.1 (CUDA 13 build; runs on the CPU), triton 3.8.0, numpy 2.4.6, torchvision
# 0.29.1, torchaudio 2.11.1, transformers 5.6.0, peft 0.18.1, accelerate 1.11.0, trl 0.24.0). Then the test extras
# the suite uses (liger-kernel, deepspeed, bitsandbytes, pytest; none of them pulls torch back), then this plugin
# (editable), then `pytest -m "not slow"` with scripts/test.sh's environment. Extra arguments go to pytest.
#
# No explicit torchvision/torchaudio pins are needed here: unlike the CPU-only torch 2.13.0+cpu of CPU_TESTING.md,
# the torch pip resolves is the regular CUDA build, and the torchvision (0.29.1, built for torch 2.14) and torchaudio
# (2.11.1, a py3-none wheel that only asks torch>=2.11) it brings load beside it. The script checks that after the
# install (torchvision's nms op, torchaudio, llamafactory.data.mm_plugin, transformers.PreTrainedModel) and stops
# if they do not. On this machine pip's config caps torch at 2.14.1 (the release on local disk); elsewhere pip may
# resolve a newer torch.
#
# Seen 2026-12-04 on the 2-core CPU machine: install 208 s (6.8 GB venv, mostly from the registry), fast tier 174 s,
# 431 passed / 0 failed / 0 skipped. triton 3.8's interpreter works with numpy 2.4 (3.6's did not: CPU_TESTING.md).
# pip prints many "WARNING: Location 'file:///opt/pypi...' is ignored" lines: this machine's pip config, harmless.
#
#   bash scripts/test_latest.sh                  # install once (about 3.5 min), then the fast tier (about 3 min)
#   bash scripts/test_latest.sh -k triton -x     # extra pytest arguments
#   FORCE_REINSTALL=1 bash scripts/test_latest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-latest
stamp=$V/.llamafactory_liger_fsdp_latest
LF='llamafactory==0.9.5'
EXTRAS='liger-kernel==0.8.5 deepspeed==0.19.8 bitsandbytes==0.50.2 pytest>=8'
want=$( { echo "$LF $EXTRAS"; cat pyproject.toml; } | sha256sum | cut -d' ' -f1)
if [ "${FORCE_REINSTALL:-0}" = 1 ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  t0=$(date +%s)
  rm -rf "$V"
  "$PY" -m venv "$V"
  $V/bin/python -m pip install -q --upgrade pip
  # What the README of LLaMA-Factory tells a user to run: nothing else pinned.
  $V/bin/python -m pip install -q "$LF"
  torch_before=$($V/bin/python -c "import torch; print(torch.__version__)")
  # The extras the test suite uses (requirements-cpu.txt), without its torch/numpy pins.
  $V/bin/python -m pip install -q $EXTRAS  # unquoted on purpose: one word each
  torch_after=$($V/bin/python -c "import torch; print(torch.__version__)")
  if [ "$torch_before" != "$torch_after" ]; then
    echo "test_latest.sh: the test extras moved torch from $torch_before to $torch_after" >&2
    exit 1
  fi
  $V/bin/python -m pip install -q -e .
  # The imports that break when torchvision/torchaudio do not match torch (CPU_TESTING.md).
  $V/bin/python - <<'EOF'
import torch, torchvision, torchaudio
assert hasattr(torch.ops.torchvision, "nms"), "torchvision's C++ ops did not load"
torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
from transformers import PreTrainedModel  # noqa: F401  (transformers imports torchvision when it is installed)
import llamafactory.data.mm_plugin  # noqa: F401  (imports torchaudio at module level)
EOF
  $V/bin/python -c "import llamafactory_liger_fsdp._bootstrap as b; assert b.ACTIVE, 'import hook not active'"
  echo "$want" > "$stamp"
  echo "test_latest.sh: install took $(( $(date +%s) - t0 )) s"
fi
$V/bin/python - <<'EOF'
from importlib.metadata import version
names = ["torch", "triton", "numpy", "transformers", "peft", "accelerate", "trl",
         "torchvision", "torchaudio", "llamafactory", "liger-kernel", "deepspeed", "bitsandbytes"]
print("test_latest.sh: " + " ".join(f"{n}=={version(n)}" for n in names))
EOF
export PATH="$PWD/$V/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
t1=$(date +%s)
rc=0
$V/bin/python -m pytest -q tests -m "not slow" "$@" || rc=$?
echo "test_latest.sh: tests took $(( $(date +%s) - t1 )) s (exit $rc)"
exit $rc
