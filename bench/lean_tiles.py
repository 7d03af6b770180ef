"""The lean ``triton`` path against its tile plan on one GPU: forward+backward ms and peak for the widest vocabulary
slab (``MAX_SLAB``) and the memory budget the planner works within, at one shape. Shows what the 1 GiB default costs.

    python bench/lean_tiles.py --out bench/results/h200_lean_tiles.json
"""

from __future__ import annotations

import argparse
import json

import torch

from common import MIB, cuda_ms, gpu_meta, make_inputs
from llamafactory_liger_fsdp.ops import triton_common, triton_flce, triton_lean


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_lean_tiles.json")
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--ignored", type=float, default=0.25)
    args = ap.parse_args()
    n, hd, v = map(int, args.shape.split(","))
    hidden, weight, y = make_inputs(n, hd, v, ignore=args.ignored)
    n_valid = int((y != -100).sum())
    rows, meta = [], gpu_meta()  # card, date, versions on every row
    for slab in (8192, 16384, 32768):
        for budget_gib in (1.0, 1.5, 2.0):
            triton_common.MAX_SLAB = slab
            budget = int(budget_gib * 1024 * MIB)
            v_s, r = triton_lean.plan_tiles(n_valid, hd, v, mem_budget=budget)
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()

            def once():
                h.grad = w.grad = None
                triton_flce.fused_linear_cross_entropy_triton(h, w, y, mem_budget=budget).backward()

            ms = cuda_ms(once, 7)
            h.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            once()
            torch.cuda.synchronize()
            grads = h.numel() * 2 + w.numel() * 2
            row = {"shape": [n, hd, v], "ignored_frac": args.ignored, "max_slab": slab, "budget_gib": budget_gib,
                   "v_s": v_s, "rows": r, "ms": ms,
                   "peak_extra_mib": (torch.cuda.max_memory_allocated() - base - grads) / MIB}
            rows.append(dict(row, **meta))
            print(json.dumps(row), flush=True)
            del h, w
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
