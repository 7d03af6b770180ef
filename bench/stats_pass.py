"""The statistics pass alone (``triton_kernels.chunk_stats``: max, sum exp, target logit per row of fp32 logits) and
the in-place dz pass beside it, on one fast-path chunk's logits: ms and GB/s read (+ written), so the pass's distance
from HBM bandwidth shows. ``--old MODULE`` also times another implementation of ``chunk_stats`` (an earlier kernel)
and checks the two agree bitwise. Rows to JSON.

    python bench/stats_pass.py --out bench/results/h200_stats_pass.json [--old bench/_old_stats.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from common import cuda_ms, gpu_meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_stats_pass.json")
    ap.add_argument("--shapes", default="3072,128256;3072,152064;3072,262208;11469,8192")
    ap.add_argument("--old", default=None)
    args = ap.parse_args()
    from llamafactory_liger_fsdp.ops import triton_kernels as tk

    impls = {"current": tk.chunk_stats}
    if args.old:
        spec = importlib.util.spec_from_file_location("old_stats", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        impls["old"] = old._chunk_stats
    rows, meta = [], gpu_meta()
    for spec_ in args.shapes.split(";"):
        c, v = map(int, spec_.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        z = torch.randn(c, v, device="cuda", generator=g) * 3
        y = torch.randint(0, v, (c,), device="cuda", generator=g)
        gb = z.numel() * 4 / 1e9
        outs = {}
        for name, fn in impls.items():
            for softcap, eps in ((None, 0.0), (30.0, 0.1)):
                ms = cuda_ms(lambda: fn(z, y, softcap, eps), reps=20, warmup=3)
                outs[(name, softcap)] = fn(z, y, softcap, eps)
                rows.append({"pass": "stats", "impl": name, "rows": c, "V": v, "softcap": softcap, "label_smoothing": eps,
                             "ms": ms, "gb_per_s": gb / ms * 1e3, **meta})
                print(json.dumps(rows[-1]), flush=True)
        if "old" in impls:
            for sc in (None, 30.0):
                same = all(a is None and b is None or torch.equal(a, b)
                           for a, b in zip(outs[("current", sc)], outs[("old", sc)]))
                rel = max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
                          for a, b in zip(outs[("current", sc)], outs[("old", sc)]) if a is not None)
                rows.append({"pass": "stats", "check": "current vs old", "rows": c, "V": v, "softcap": sc,
                             "bitwise_equal": same, "max_rel_diff": rel, **meta})
                print(json.dumps(rows[-1]), flush=True)
        m, s, _, _ = tk.chunk_stats(z, y, None, 0.0)
        dz = tk.dz_over(z, torch.bfloat16)
        ms = cuda_ms(lambda: tk.launch_dz_inplace(z, dz, m, 1.0 / s, None, 0.0, v, 1.0), reps=20, warmup=3)
        rows.append({"pass": "dz_inplace", "impl": "current", "rows": c, "V": v, "ms": ms,
                     "gb_per_s": gb * 1.5 / ms * 1e3, **meta})
        print(json.dumps(rows[-1]), flush=True)
        del z, dz
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
