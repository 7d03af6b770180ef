#!/usr/bin/env bash
# Builds .whl/: the wheels a device call carries (`carry: [".whl"]`) for what the GPU image lacks, plus the plugin's own
# wheel and .whl/PLUGIN_COMMIT (recorded on every bench row). bench/run_gpu.sh installs every wheel found there.
#   bash bench/make_wheels.sh            # from the repository root; needs the package registries (~15 s)
# The image runs CPython 3.12 on x86_64. DeepSpeed is published as a source archive only: it is built here into a
# pure-Python wheel (DS_BUILD_OPS=0, ops compiled at first use as DeepSpeed does by default), with its small
# dependencies beside it (pydantic too: the image has none); without it every ZeRO-3 run ends in "DeepSpeed is not
# available". Checked by importing deepspeed.runtime.zero.stage3 in a venv holding only torch and these wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
get() {
  PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: -d .whl --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "$@"
}
get liger-kernel==0.8.5 llamafactory==0.9.5 transformers==5.6.0 peft==0.18.1 \
  accelerate==1.11.0 trl==0.24.0 datasets==4.0.0 tokenizers==0.22.2 omegaconf==2.4.0 dill==0.3.8 \
  multiprocess==0.70.16 torchdata==0.11.0 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 einops==0.8.2 \
  pydantic==2.12.3 pydantic_core==2.41.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" deepspeed==0.19.8
tar -xzf "$tmp"/deepspeed-0.19.8.tar.gz -C "$tmp"
python3 -m venv "$tmp/venv" && "$tmp/venv/bin/pip" install -q wheel setuptools  # DeepSpeed's setup.py wants bdist_wheel
DS_BUILD_OPS=0 "$tmp/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w .whl "$tmp/deepspeed-0.19.8"
python3 -m pip wheel -q --no-deps -w .whl .
rm -rf build ./*.egg-info
git rev-parse HEAD > .whl/PLUGIN_COMMIT
bash bench/run_gpu.sh source-hash > .whl/PLUGIN_SOURCE  # run_gpu.sh refuses a wheel older than the tree
ls .whl && du -sh .whl
