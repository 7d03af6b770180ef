"""Where the "cold" call's extra milliseconds go: the benchmark times a fused loss call with the GPU idle at its start
(``cold``), ``profile_flce.py``'s GPU-bound time hides the host's start behind a queued GPU sleep (``hidden``); on the
H200 the two differ by ~3.6 ms at 16k x 4096 x 128k. This separates host work from GPU clock state.

Per implementation, medians of ``reps`` forward+backward calls: ``cold``; ``cold_after_idle`` (the host sleeps 15 ms
first: the GPU idles as long as ``hidden``'s sleep kernel runs); ``hidden`` (a 15 ms GPU sleep queued first, the
events around the call only); and inside the cold call, with host timestamps and CUDA events: the host's time from
the call to its first GEMM launch, the GPU's time from the start event to that GEMM's start, forward's host time, and
the GPU time of the first GEMM onwards. Rows to JSON.

    python bench/start_cost.py --out bench/results/h200_start_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import flce_impl, gpu_meta, make_inputs


def _ev():
    return torch.cuda.Event(enable_timing=True)


def measure(fn, h, w, y, reps):
    from llamafactory_liger_fsdp.ops import triton_common

    out = {"cold": [], "cold_after_idle": [], "hidden": [], "host_to_first_gemm_ms": [], "gpu_to_first_gemm_ms": [],
           "host_forward_ms": [], "gpu_first_gemm_to_end_ms": []}
    real_mm = triton_common.mm_f32
    mark = {}

    def mm(*a, **k):
        if "t" not in mark:
            mark["t"] = time.perf_counter()
            mark["ev"] = _ev()
            mark["ev"].record()
        return real_mm(*a, **k)

    triton_common.mm_f32 = mm
    try:
        for _ in range(reps):
            for mode in ("cold", "cold_after_idle", "hidden"):
                h.grad = w.grad = None
                mark.clear()
                torch.cuda.synchronize()
                if mode == "cold_after_idle":
                    time.sleep(0.015)
                if mode == "hidden":
                    torch.cuda._sleep(int(3e7))
                a, b = _ev(), _ev()
                a.record()
                t0 = time.perf_counter()
                loss = fn(h, w, y)
                t1 = time.perf_counter()
                loss.backward()
                b.record()
                torch.cuda.synchronize()
                out[mode].append(a.elapsed_time(b))
                if mode == "cold" and "ev" in mark:
                    out["host_to_first_gemm_ms"].append((mark["t"] - t0) * 1e3)
                    out["gpu_to_first_gemm_ms"].append(a.elapsed_time(mark["ev"]))
                    out["gpu_first_gemm_to_end_ms"].append(mark["ev"].elapsed_time(b))
                    out["host_forward_ms"].append((t1 - t0) * 1e3)
    finally:
        triton_common.mm_f32 = real_mm
    return {k: statistics.median(v) for k, v in out.items() if v}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_start_cost.json")
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--impls", default="project_fast,project")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    n, hd, v = map(int, args.shape.split(","))
    hidden, weight, y = make_inputs(n, hd, v, ignore=0.3)
    rows = []
    for name in args.impls.split(","):
        fn = flce_impl(name)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        for _ in range(3):
            fn(h, w, y).backward()
        row = {"impl": name, "shape": [n, hd, v], "ignored_frac": 0.3, **measure(fn, h, w, y, args.reps), **gpu_meta()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del h, w
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
