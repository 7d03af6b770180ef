#!/usr/bin/env bash
# The plugin on the stacks users install today, each in its own venv built the way a user builds it (pip's defaults,
# nothing pinned; this machine's pip cap on torch is lifted with PIP_CONSTRAINT=/dev/null):
#   pypi  `pip install llamafactory==0.9.5` as PyPI resolves it now (seen 2026-12-04: torch 2.15.0, triton 3.9.0,
#         numpy 2.4.6, transformers 5.6.0, peft 0.18.1, accelerate 1.11.0)
#   main  LLaMA-Factory git main from source, `pip install -e` of the snapshot in ../shared/llamafactory-main
#         (0.9.6.dev0; pip resolves transformers 5.8.0, the newest it allows, torch 2.15.0, triton 3.9.0)
# For each: installing the plugin (`pip install -e .`, with its dependencies) must leave llamafactory, torch,
# triton, transformers, peft and accelerate exactly as they were; the tiny recipe trains through `llamafactory-cli
# train` with the engaged line and `guard: step 1 exact`; then the fast test tier and the end-to-end runs in E2E
# (FSDP2 on two ranks, ZeRO-3, DPO, the guard stopping a changed loss).
#
#   bash scripts/test_stacks.sh [pypi|main|all] [extra pytest args]
#   bash scripts/test_stacks.sh prepare   # only build the venvs that are missing
#
# The venvs are cached outside the checkout (LLF_STACKS_CACHE, default ~/.cache/llamafactory-liger-fsdp), keyed by
# what they install, so a second run (or CI on the same machine) only reinstalls the plugin. Seen 2026-12-04 on the
# 2-core machine: a venv from nothing about 2.5 minutes (the torch download included), its tests about 4 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHICH=${1:-all}
[ $# -gt 0 ] && shift
PY=${PYTHON:-python3}
CACHE=${LLF_STACKS_CACHE:-$HOME/.cache/llamafactory-liger-fsdp}
SHARED=${LLF_SHARED:-$(cd .. && pwd)/shared}
EXTRAS='liger-kernel==0.8.5 deepspeed==0.19.8 bitsandbytes==0.50.2 pytest>=8 pytest-xdist==3.8.0'
NAMES='llamafactory torch triton transformers peft accelerate'
E2E=(tests/test_e2e_checkpoints.py::test_fsdp2_two_ranks
     tests/test_e2e_deepspeed.py::test_zero3_engages_and_equals_plain
     tests/test_e2e_preference.py::test_dpo_fsdp2
     tests/test_e2e_versions.py
     "tests/test_v1_dist.py::test_fsdp2_equals_v1s_own[lora]"
     tests/test_v1_dist.py::test_dpo_equals_v1s_own)
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$CACHE"

versions() {  # name==version of NAMES in venv $1
  "$1/bin/python" - $NAMES <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for n in sys.argv[1:]:
    try:
        print(f"{n}=={version(n)}")
    except PackageNotFoundError:
        print(f"{n} not installed")
EOF
}

build() {  # build STACK VENV: the user's install, then the test extras (which must not move the stack)
  local stack=$1 v=$2 t0=$SECONDS
  rm -rf "$v"
  "$PY" -m venv "$v"
  "$v/bin/python" -m pip install -q --upgrade pip
  if [ "$stack" = pypi ]; then
    "$v/bin/python" -m pip install -q 'llamafactory==0.9.5'
  else
    local tarball
    tarball=$(ls "$SHARED"/llamafactory-main/LLaMA-Factory-*.tar.gz 2>/dev/null | head -1)
    if [ -z "$tarball" ]; then
      echo "test_stacks.sh: no LLaMA-Factory snapshot in $SHARED/llamafactory-main" >&2
      exit 1
    fi
    rm -rf "$v/src" && mkdir -p "$v/src"
    tar -xzf "$tarball" -C "$v/src"
    "$v/bin/python" -m pip install -q -e "$v/src/LLaMA-Factory"
  fi
  versions "$v" > "$v/stack.txt"
  "$v/bin/python" -m pip install -q $EXTRAS  # unquoted on purpose: one word each
  if ! versions "$v" | diff -u "$v/stack.txt" - >&2; then
    echo "test_stacks.sh: the test extras moved the $stack stack" >&2
    exit 1
  fi
  # the imports that break when torchvision/torchaudio do not match torch (../shared/CPU_TESTING.md)
  "$v/bin/python" -c "import torch, torchvision, torchaudio; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5); from transformers import PreTrainedModel; import llamafactory.data.mm_plugin"
  echo "test_stacks.sh: $stack venv built in $((SECONDS - t0)) s"
}

venv_of() {  # the cached venv of stack $1, built if missing; keyed by what is installed (the snapshot by its name),
  # not by where this checkout or shared/ sits
  local key v
  key=$( { echo "$1 $EXTRAS"; [ "$1" != main ] || basename "$SHARED"/llamafactory-main/LLaMA-Factory-*.tar.gz; } \
        | sha256sum | cut -c1-12)
  v="$CACHE/venv-$1-$key"
  if [ ! -f "$v/.built" ]; then
    build "$1" "$v" >&2
    touch "$v/.built"
  fi
  echo "$v"
}

run_stack() {  # called without `||` around it, so `set -e` holds inside; the two pytest runs both run
  local stack=$1 v t0=$SECONDS rc=0 out would
  shift
  v=$(venv_of "$stack")
  # the plugin, as a user installs it (with its dependencies): the stack must not move, for `pip install .` (what
  # pip would do) and `pip install -e .` (done)
  would=$("$v/bin/python" -m pip install --dry-run "$ROOT" 2>/dev/null | grep "^Would install" || true)
  if [ "$would" != "Would install llamafactory-liger-fsdp-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)" ]; then
    echo "test_stacks.sh: pip install . would change the $stack stack: $would" >&2
    exit 1
  fi
  "$v/bin/python" -m pip install -q -e "$ROOT"
  if ! versions "$v" | diff -u "$v/stack.txt" - >&2; then
    echo "test_stacks.sh: installing the plugin changed the $stack stack" >&2
    exit 1
  fi
  echo "test_stacks.sh: $stack stack unchanged by the plugin's install: $(tr '\n' ' ' < "$v/stack.txt")"
  export PATH="$v/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR="$v/torch_extensions"
  # the main job on this stack: the tiny recipe as shipped, no override key
  out=$(mktemp -d)
  python recipes/tiny_cpu/make_assets.py "$out/tiny_assets" > /dev/null
  sed "s#outputs/#$out/#" recipes/tiny_cpu/sft.yaml > "$out/sft.yaml"
  if ! llamafactory-cli train "$out/sft.yaml" > "$out/train.log" 2>&1 \
      || ! grep -q "\[liger_fsdp\] engaged" "$out/train.log" || ! grep -q "\[liger_fsdp\] guard: step 1 exact" "$out/train.log"; then
    tail -40 "$out/train.log" >&2
    echo "test_stacks.sh: the tiny recipe did not train engaged with an exact guard on the $stack stack" >&2
    exit 1
  fi
  grep -o "\[liger_fsdp\] \(engaged\|guard: step 1 exact\|untested\).\{0,100\}" "$out/train.log"
  rm -rf "$out"
  python -m pytest -q -n 2 --dist loadfile tests -m "not slow" "$@" || rc=1
  local e2e=("${E2E[@]}")
  # git main's v1 (top-level cp_size, DPO): CP at cp 2 against cp 1 and v1's own loss, the guard, RM / DPO, the cluster
  # (cp 4 and the LoRA head at CP: the pinned stack; test_v1_cp.py launches only what the selected tests read)
  [ "$stack" != main ] || e2e+=("tests/test_v1_cp.py::test_fused_cp_loss_trains_as_reference[cp2_plugin-cp1_plugin]"
    "tests/test_v1_cp.py::test_fused_cp_loss_trains_as_reference[cp2_plugin-cp2_v1]"
    "tests/test_v1_cp.py::test_each_rank_received_its_part_of_every_sequence[cp2_plugin]"
    "tests/test_v1_cp.py::test_each_rank_received_its_part_of_every_sequence[cp2_v1]"
    tests/test_v1_cp.py::test_guard_stops_a_one_percent_error_in_the_cp_loss
    tests/test_v1_cp_pref.py tests/test_v1_cp_cluster.py)
  python -m pytest -q -n 2 --dist loadfile "${e2e[@]}" "$@" || rc=1
  echo "test_stacks.sh: $stack stack: exit $rc in $((SECONDS - t0)) s"
  exit $rc
}

case "$WHICH" in
  pypi|main) run_stack "$WHICH" "$@" ;;
  prepare)  # build the missing venvs only (test.sh runs this beside the pinned tests: mostly downloads and unpacking)
    for s in pypi main; do venv_of "$s" > /dev/null; done ;;
  all)
    status=0
    for s in pypi main; do bash "$0" "$s" "$@" || status=1; done
    exit $status ;;
  *) echo "usage: bash scripts/test_stacks.sh [pypi|main|all|prepare] [pytest args]" >&2; exit 2 ;;
esac
