#!/usr/bin/env bash
# Install everything, then run a short real LoRA + embed_tokens/lm_head training with
# `liger_fsdp: true` through `llamafactory-cli train` on a tiny local model (CPU; about 3 minutes from a fresh clone,
# nearly all of it pip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1
python recipes/tiny_cpu/make_assets.py outputs/tiny_assets
llamafactory-cli train recipes/tiny_cpu/sft.yaml 2>&1 | tee outputs/tiny_cpu_train.log
grep -q "\[liger_fsdp\] engaged" outputs/tiny_cpu_train.log && echo "OK: liger_fsdp engaged; adapter in outputs/tiny_cpu_lora"
