#!/usr/bin/env bash
# What was run on the lent H200 (device tool), so anyone can rerun it:
#   bash bench/run_h200.sh kernel   # real-size kernel checks + the FLCE benchmark + CPU parity tests on the image's newer stack
#   bash bench/run_h200.sh sft      # real-size LLaMA-Factory SFT runs (bench/real_size_sft.py)
#   bash bench/run_h200.sh all      # kernel benchmark + checks, then the SFT runs
#   KERNEL3_LIMIT=320 bash bench/run_h200.sh kernel3   # real-size checks, then the kernel at 0/25/50% ignored labels
#   bash bench/run_h200.sh reach zero3|dpo   # bench/reach_h200.py: ZeRO-3 SFT, DPO, the guard's cost
#   bash bench/run_h200.sh multi    # bench/multi_gpu_fsdp.py on every GPU of the machine (on one GPU:
#                                   # FSDP2 at world size 1, 20-step curves, as far as one GPU goes)
#   SPEED_ARGS="--scenarios fsdp2_sft,zero3_sft_bf16" bash bench/run_h200.sh speed
#                                   # bench/speed_h200.py: side-by-side runs per scenario and variant, appended to
#                                   # $OUT/h200_speed.json, which starts as a copy of bench/results/h200_speed.json when
#                                   # there is one (copy the returned file back there between calls); the whole command
#                                   # stays under SPEED_LIMIT s (default 570): no run starts past the deadline
#   V1_ARGS="--runs 2" bash bench/run_h200.sh v1
#                                   # bench/v1_h200.py: LLaMA-Factory's v1 engine (v1_launch.py), plain vs the plugin's
#                                   # kernel, 2-layer Llama-3-8B shape, 16k tokens, FSDP2; rows to $OUT/h200_v1.json
#   DEPTH_ARGS="--plan sweep,repeat" bash bench/run_h200.sh depth
#                                   # bench/depth_h200.py: the 32-layer Llama-3-8B runs (longest cutoff per variant),
#                                   # appended to $OUT/h200_depth.json (starts as a copy of bench/results/h200_depth.json;
#                                   # copy it back between calls); whole command under DEPTH_LIMIT s (default 570)
#   DPO_ARGS="--runs 2" bash bench/run_h200.sh dpo   # bench/depth_dpo_vlm_h200.py dpo (32-layer Llama-3-8B, 2k/8k a side)
#   VLM_ARGS="--runs 2" bash bench/run_h200.sh vlm   # ... vlm (Qwen2.5-VL-7B at depth, images); both append to
#                                   # $OUT/h200_depth.json like depth (copy it back between calls); under PART_LIMIT s
# Wheels that the image lacks travel in .whl/ (built by bench/make_wheels.sh); results go to $OUT (or bench/results).
# Every bench script imports bench/common.py (found next to it) and the package llamafactory_liger_fsdp: the cases
# below install it or put the checkout on PYTHONPATH; the one-shot kernel probes (bench/gemm_shapes.py,
# lean_tiles.py, lora_head_kernel.py, profile_flce.py, start_cost.py, stats_pass.py, triton_gemm_probe.py) are run
# as `PYTHONPATH=$PWD python3 bench/<script>.py --out $OUT/...`.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" || exit 1; }
install_stack() {  # the plugin's wheel pip-installed for real (its .pth hook must land in site-packages), then the rest
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/llamafactory_liger_fsdp-*.whl || exit 1
  install $(ls .whl/*.whl | grep -v llamafactory_liger_fsdp)
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
}
keep_rows() {  # $OUT/$1 starts as a copy of bench/results/$1: the rows so far, appended to (copy it back between calls);
  # so does its h100_ twin, where the scripts put the rows of a call that got an H100 (common.rows_for_card)
  for f in "$1" "h100_${1#h200_}"; do
    if [ -f "bench/results/$f" ] && [ ! -e "$OUT/$f" ]; then cp "bench/results/$f" "$OUT/$f"; fi
  done
}
case "${1:-kernel}" in
  kernel|kernel-only)
    install .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python3 -c "import torch,transformers,peft,accelerate,triton;print(torch.__version__,transformers.__version__,peft.__version__,accelerate.__version__,triton.__version__)"
    timeout 290 python3 bench/bench_flce.py --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log"
    timeout 90 python3 bench/bench_flce.py --check --out "$OUT/h200_check.json" 2>&1 | tee "$OUT/check.log"
    [ "$1" = kernel-only ] && exit 0
    OMP_NUM_THREADS=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_single_parity.py tests/test_dist_parity.py 2>&1 | tail -5 | tee "$OUT/compat_tests.log"
    ;;
  kernel3)
    # issue 20's table (0 / 25 / 50% ignored labels, floor_valid_ms per row) after the real-size checks, within
    # KERNEL3_LIMIT s (default 320) for both
    install .whl/liger_kernel-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    limit=${KERNEL3_LIMIT:-320}
    timeout $((limit * 3 / 10)) python3 bench/bench_flce.py --check --out "$OUT/h200_kernel3_check.json" > "$OUT/check3.log" 2>&1
    timeout $((limit - SECONDS)) python3 bench/bench_flce.py --ignored 0,0.25,0.5 --impls ${KERNEL3_IMPLS:-project_fast,project,liger} \
      --deadline-s $((limit - 30 - SECONDS)) --out "$OUT/h200_kernel3.json" 2>&1 | tail -60 | tee "$OUT/kernel3.log"
    ;;
  all)
    OUT=$OUT bash "$0" kernel-only
    OUT=$OUT bash "$0" sft
    ;;
  depth)
    install_stack  # the plugin's wheel is built from a commit (.whl/PLUGIN_COMMIT, recorded on every row)
    limit=${DEPTH_LIMIT:-570}  # seconds for this whole command, the installs above included
    nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,temperature.gpu --format=csv,noheader
    keep_rows h200_depth.json
    timeout $((limit - SECONDS)) python3 bench/depth_h200.py --out "$OUT/h200_depth.json" \
      --deadline $((limit - 10 - SECONDS)) ${DEPTH_ARGS:-} 2>&1 | tee "$OUT/depth.log"
    for f in /tmp/real_size/fsdp2_*_r[0-9]*.log /tmp/real_size/zero3_*_r[0-9]*.log; do  # runs with no result JSON
      [ -e "$f" ] && [ ! -s "${f%.log}.json" ] && { echo "=== $f"; tail -c 4000 "$f"; }
    done > "$OUT/depth_fail.log" 2>/dev/null
    exit 0
    ;;
  dpo|vlm)
    install_stack
    limit=${PART_LIMIT:-570}
    keep_rows h200_depth.json
    args=$([ "$1" = dpo ] && echo "${DPO_ARGS:-}" || echo "${VLM_ARGS:-}")
    timeout $((limit - SECONDS)) python3 bench/depth_dpo_vlm_h200.py "$1" --out "$OUT/h200_depth.json" \
      --deadline $((limit - 15 - SECONDS)) $args 2>&1 | tee "$OUT/$1.log"
    for f in /tmp/real_size/$1_*_r[0-9]*.log; do  # failed runs only
      [ -e "$f" ] && [ ! -s "${f%.log}.json" ] && tail -c 3000 "$f" > "$OUT/$1_run_$(basename "$f")"
    done
    exit 0
    ;;
  v1)
    # bench/v1_h200.py: LLaMA-Factory's v1 engine, v1's own SFT against the plugin's kernel (issue 29's figure), rows
    # appended to $OUT/h200_v1.json (starts as a copy of bench/results/h200_v1.json); under V1_LIMIT s (default 570)
    install_stack
    limit=${V1_LIMIT:-570}
    keep_rows h200_v1.json
    timeout $((limit - SECONDS)) python3 bench/v1_h200.py --out "$OUT/h200_v1.json" --work /tmp/v1_bench \
      --deadline $((limit - 15 - SECONDS)) ${V1_ARGS:-} 2>&1 | tee "$OUT/v1.log"
    for f in /tmp/v1_bench/*_r[0-9]*.log; do  # failed runs only (no result JSON): at most 8 files come back
      [ -e "$f" ] && [ ! -s "${f%.log}.json" ] && tail -c 4000 "$f" > "$OUT/v1_run_$(basename "$f")"
    done
    exit 0
    ;;
  sft|multi|reach|speed)
    install_stack
    python3 -c "import transformers,peft,accelerate,llamafactory;print(transformers.__version__,peft.__version__,accelerate.__version__,llamafactory.__version__)"
    if [ "$1" = reach ]; then
      timeout 570 python3 bench/reach_h200.py "$2" --out "$OUT/h200_reach_$2.json" ${REACH_ARGS:-} 2>&1 | tee "$OUT/reach_$2.log"
      tail -c 6000 /tmp/real_size/*.log > "$OUT/reach_$2_runs.log" 2>/dev/null
      exit 0
    fi
    if [ "$1" = speed ]; then
      limit=${SPEED_LIMIT:-570}  # seconds for this whole command, the installs above included
      keep_rows h200_speed.json
      timeout $((limit - SECONDS)) python3 bench/speed_h200.py --out "$OUT/h200_speed.json" --deadline $((limit - 15 - SECONDS)) \
        ${SPEED_ARGS:-} 2>&1 | tee "$OUT/speed.log"
      for f in /tmp/real_size/*_r[0-9]*.log; do  # failed runs (no result JSON) keep a longer log tail
        [ -e "$f" ] && [ ! -s "${f%.log}.json" ] && tail -c 6000 "$f" > "$OUT/speed_fail_$(basename "$f")"
      done 2>/dev/null
      exit 0
    fi
    if [ "$1" = multi ]; then
      nproc=$(nvidia-smi -L | wc -l)
      if [ "$nproc" -ge 2 ]; then
        args="--parts repro,curves,heads --fsdp 1,2"
      else  # FSDP1 does not shard at world size 1, and nothing crashes there: FSDP2 only
        args="--parts curves,heads --fsdp 2 --head-steps 20"
      fi
      timeout 560 python3 bench/multi_gpu_fsdp.py --nproc "$nproc" $args --out "$OUT/h200x${nproc}_fsdp.json" ${MULTI_ARGS:-} 2>&1 | tee "$OUT/multi.log"
      exit 0
    fi
    timeout 420 python3 bench/real_size_sft.py --out "$OUT/h200_sft.json" ${SFT_ARGS:-} 2>&1 | tee "$OUT/sft.log"
    tail -c 20000 /tmp/real_size/*_liger_fsdp.log > "$OUT/liger_fsdp_runs.log" 2>/dev/null
    ;;
esac
