#!/usr/bin/env bash
# One GPU call of a bench script on a machine whose image has torch and triton but not the rest of the stack (the
# lent device tool's), so anyone can rerun the figures of bench/RESULTS.md:
#   bash bench/run_gpu.sh kernel                          # bench_flce.py --check (CHECK=0: not), then the benchmark
#                                                         # (KERNEL_ARGS; rows to <card>_${KERNEL_ROWS:-kernel3}.json)
#   DEPTH_ARGS="sft --cutoffs 32768 --search" bash bench/run_gpu.sh depth   # bench/depth.py (sft, dpo or vlm)
#   SPEED_ARGS="--scenarios fsdp2_sft --runs 2" bash bench/run_gpu.sh speed # bench/speed.py
#   V1_ARGS="--runs 2" bash bench/run_gpu.sh v1                              # bench/v1.py
#   bash bench/run_gpu.sh v1cp   # bench/v1.py at 32 layers, cp_size 1: the card's check of bench/twin_cp.py; V1CP_ARGS:
#                                # ';'-separated argument sets, one bench/v1.py call each (after V1CP_BASE)
#   bash bench/run_gpu.sh multi                           # bench/multi_gpu_fsdp.py on every GPU of the machine
# LIMIT (seconds, default 570) bounds the whole command, the installs included: each script gets the rest as its
# --deadline. Wheels that the image lacks travel in .whl/ (bash bench/make_wheels.sh builds them: LLaMA-Factory's stack,
# Liger, DeepSpeed and the plugin's own wheel, pip-installed so its .pth hook is real). Rows go to $OUT (default
# bench/results) as <card>_<kind>.json; each starts as a copy of bench/results' file of that name, so copy it back
# after the call. Runs that failed leave their log tail in $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
LIMIT=${LIMIT:-570}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" || exit 1; }
source_hash() {  # the package's files as the working tree has them (make_wheels.sh keeps the wheel's in .whl/PLUGIN_SOURCE)
  find llamafactory_liger_fsdp -type f \( -name '*.py' -o -name '*.json' -o -name '*.pth' \) | LC_ALL=C sort | xargs sha256sum \
    | sha256sum | cut -c1-16
}
install_stack() {  # the plugin's wheel pip-installed for real (its .pth hook must land in site-packages), then the rest
  if [ "$(cat .whl/PLUGIN_SOURCE 2>/dev/null)" != "$(source_hash)" ]; then  # a stale wheel fails every run at import
    echo "run_gpu.sh: .whl/ holds a plugin wheel built from other sources than this tree: bash bench/make_wheels.sh" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --force-reinstall .whl/llamafactory_liger_fsdp-*.whl || exit 1
  install $(ls .whl/*.whl | grep -v llamafactory_liger_fsdp)
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
}
keep_rows() {  # $OUT/<card>_$1.json starts as a copy of bench/results' (the rows so far, appended to)
  for f in bench/results/*_"$1".json bench/results/*_"$1"_small.json; do
    if [ -f "$f" ] && [ ! -e "$OUT/$(basename "$f")" ]; then cp "$f" "$OUT/"; fi
  done
}
failed_logs() {  # the log tails of runs that left no result JSON
  for f in "$1"/*_r[0-9]*.log; do
    [ -e "$f" ] && [ ! -s "${f%.log}.json" ] && tail -c 4000 "$f" > "$OUT/fail_$(basename "$f")"
  done 2>/dev/null
}
[ "${1:-}" != source-hash ] || { source_hash; exit 0; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
case "${1:-}" in
  kernel)
    install .whl/liger_kernel-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    if [ "${CHECK:-1}" = 1 ]; then  # CHECK=0: the sweep alone
      timeout $((LIMIT * 3 / 10)) python3 bench/bench_flce.py --check --out "$OUT/{card}_kernel3_check.json" > "$OUT/check.log" 2>&1
    fi
    timeout $((LIMIT - SECONDS)) python3 bench/bench_flce.py --deadline $((LIMIT - 30 - SECONDS)) \
      --out "$OUT/{card}_${KERNEL_ROWS:-kernel3}.json" ${KERNEL_ARGS:-} 2>&1 | tail -60 | tee "$OUT/kernel.log"
    ;;
  depth|speed|v1|v1cp)
    install_stack  # the plugin's wheel is built from a commit (.whl/PLUGIN_COMMIT, recorded on the depth rows)
    keep_rows "$1"
    work=/tmp/real_size script=$1 base=""
    case "$1" in
      depth) sets=${DEPTH_ARGS:-sft} ;;
      speed) sets=${SPEED_ARGS:-} ;;
      v1) sets=${V1_ARGS:-} work=/tmp/v1_bench ;;
      v1cp) script=v1 work=/tmp/v1_bench base=${V1CP_BASE:-"--layers 32 --micro-batch 2 --runs 1 --steps 3"}
        sets=${V1CP_ARGS:-"--cutoff 16384 --variants plain-head,plugin-head"} ;;
    esac
    IFS=';' read -ra sets <<< "$sets"
    for args in "${sets[@]:-}"; do  # one call of the script per set, each with the time that is left
      out="$OUT/{card}_$1.json"  # depth: a small model's rows to {card}_depth_small.json (depth.py's {small})
      [ "$1" != depth ] || out="$OUT/{card}_depth{small}.json"
      timeout $((LIMIT - SECONDS)) python3 "bench/$script.py" $base $args --out "$out" --work $work \
        --deadline $((LIMIT - 15 - SECONDS)) 2>&1 | tee -a "$OUT/$1.log"
    done
    failed_logs $work
    ;;
  multi)
    install_stack
    nproc=$(nvidia-smi -L | wc -l)
    if [ "$nproc" -ge 2 ]; then
      args="--parts repro,curves,heads --fsdp 1,2"
    else  # FSDP1 does not shard at world size 1, and nothing crashes there: FSDP2 only
      args="--parts curves,heads --fsdp 2 --head-steps 20"
    fi
    timeout $((LIMIT - SECONDS)) python3 bench/multi_gpu_fsdp.py --nproc "$nproc" $args \
      --out "$OUT/{card}x${nproc}_fsdp.json" ${MULTI_ARGS:-} 2>&1 | tee "$OUT/multi.log"
    ;;
  *)
    echo "usage: bash bench/run_gpu.sh kernel|depth|speed|v1|v1cp|multi (see the comment at the top)" >&2
    exit 2
    ;;
esac
exit 0
