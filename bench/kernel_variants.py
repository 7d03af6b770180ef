"""Issue 50's A/B of the fused logits GEMM (``ops/triton_fused.py``) in one GPU call: first the phases of one chunk
(cuBLAS logits, the statistics and dz passes, the two gradient GEMMs, the fused GEMM's three epilogues, with and
without warp specialization), then the whole loss (forward + backward, ``bench_flce.bench_impl``: median of 10 after
3 warm-ups, errors against the fp32 reference) per variant, shape and ignored fraction. Rows to JSON; a table last.

    PYTHONPATH=$PWD python bench/kernel_variants.py --out $OUT/h100_kernel4_variants.json [--deadline 400]
"""

from __future__ import annotations

import argparse
import json
import time

import bench_flce as bf
import torch
from common import card_key, dump_json

BIG = 1 << 30
# name: (backend, RULES, FAST_CHUNK_ROWS, RECOMPUTE_ROWS_X)
VARIANTS = {
    "fast": ("triton_fast", [], 3072, 2),
    "fast_c6k": ("triton_fast", [], 6144, 2),
    "fast_stats": ("triton_fast", [(BIG, "stats", False)], 3072, 2),
    "fast_rec": ("triton_fast", [(BIG, "recompute", False)], 3072, 2),
    "fast_rec_x4": ("triton_fast", [(BIG, "recompute", False)], 3072, 4),
    "lean": ("triton", [], 3072, 2),
    "lean_fused": ("triton", [(BIG, None, True)], 3072, 2),
}
SHAPES = "16384,896,151936;16384,1152,262144;16384,2048,151936;16384,4096,128256"


def set_variant(name):
    from llamafactory_liger_fsdp.ops import triton_common, triton_fused

    backend, rules, rows, x = VARIANTS[name]
    triton_fused.RULES, triton_common.FAST_CHUNK_ROWS, triton_fused.RECOMPUTE_ROWS_X = rules, rows, x
    return backend


def phases(shape, c=3072):
    """ms of each step of one c-row chunk (triton.testing.do_bench, median, L2 flushed between runs)."""
    import triton

    from llamafactory_liger_fsdp.ops import triton_common as tc
    from llamafactory_liger_fsdp.ops import triton_fused as tf
    from llamafactory_liger_fsdp.ops import triton_kernels as tk

    _, hd, v = shape
    h, w, y = bf.make_inputs(c, hd, v, ignore=0.0)
    z = torch.empty(c, v, device="cuda", dtype=torch.float32)
    dz16 = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(c, hd, device="cuda", dtype=torch.float32)
    acc = torch.zeros(v, hd, device="cuda", dtype=torch.float32)
    tc.mm_f32(h, w.t(), out=z)
    m, s, _, _ = tk.chunk_stats(z, y, None, 0.0)
    inv_s = 1.0 / s
    tk.launch_dz(z, dz16, m, inv_s, None, 0.0, v, 1.0)
    steps = {
        "cublas_logits": lambda: tc.mm_f32(h, w.t(), out=z),
        "stats_pass": lambda: tk.chunk_stats(z, y, None, 0.0),
        "dz_pass_inplace": lambda: tk.launch_dz_inplace(z, tk.dz_over(z, torch.bfloat16), m, inv_s, None, 0.0, v, 1.0),
        "dh_gemm": lambda: tc.mm_f32(dz16, w, out=dh),
        "dw_gemm_acc": lambda: tc.addmm_f32_(acc, dz16.t(), h),
    }
    for ws in (True, False):
        tag = "" if ws else "_nows"

        def fused(epi, ws=ws):
            tf.CONFIG = tf.CONFIG[:6] + (ws,)
            if epi == 2:
                return tf.logits_dz(h, w, dz16, m, inv_s, None, 0.0, v, 1.0)
            return tf.logits_stats(h, w, y, None, 0.0, z_out=z if epi == 1 else None)

        steps.update({f"fused_stats{tag}": lambda f=fused: f(0), f"fused_stats_z{tag}": lambda f=fused: f(1),
                      f"fused_dz{tag}": lambda f=fused: f(2)})
    rows = []
    for name, fn in steps.items():
        row = {"phase": name, "shape": [c, hd, v], "flops_gemm": 2 * c * hd * v}
        tf._failed.clear()
        try:
            row["ms"] = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
            row["tflops"] = row["flops_gemm"] / row["ms"] / 1e9
        except Exception as exc:  # noqa: BLE001 -- a variant that fails is reported, not hidden
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if tf._failed:  # the fused kernel did not compile: its time is nothing's
            row["error"] = tf._failed[0]
            row.pop("ms", None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ws_ok = not any("error" in r for r in rows if r["phase"] in ("fused_stats", "fused_dz"))
    tf.CONFIG = tf.CONFIG[:6] + (ws_ok,)  # the variants run with what compiled
    tf._failed.clear()
    ok = tf.logits_dz(h, w, dz16, m, inv_s, None, 0.0, v, 1.0)
    ref = torch.empty_like(dz16)
    tk.launch_dz(tc.mm_f32(h, w.t(), out=z), ref, m, inv_s, None, 0.0, v, 1.0)
    rows.append({"phase": "fused_dz_vs_cublas_pass", "shape": [c, hd, v], "ran": ok,
                 "max_abs_diff": float((dz16.float() - ref.float()).abs().max()), "failed": list(tf._failed)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def check_fused(args, meta, rows, out, t0):
    """bench_flce's --check grid with the fused paths forced on (rows to --check-out, a summary row)."""
    if args.check_out and time.time() - t0 < args.deadline:
        from llamafactory_liger_fsdp.ops import triton_fused

        triton_fused.RULES = [(BIG, "recompute", True)]
        checks = []
        bf.check(checks, args.check_out.replace("{card}", card_key(meta["card"])))
        rows.append({"check_rules": triton_fused.RULES, "n_checks": len(checks),
                     "worst_x_floor": max((max(c["err_dx"] / c["floor_dx"], c["err_dw"] / c["floor_dw"]) for c in checks
                                           if "err_dx" in c and c.get("floor_dx") and c["backend"] != "torch"
                                           and c["dtype"] != "float32"), default=None),
                     "errors": [c for c in checks if "error" in c][:3]})
        print("check summary", json.dumps(rows[-1]), flush=True)
        dump_json(out, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="the rows JSON, e.g. bench/results/h100_kernel4_variants.json")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--variants", default=",".join(VARIANTS) + ",liger")
    ap.add_argument("--small-variants", default="fast,fast_stats,fast_rec,lean,lean_fused",
                    help="at 0%% / 50%% ignored (25%% runs every variant)")
    ap.add_argument("--deadline", type=float, default=1e9)
    ap.add_argument("--check-out", default=None, help="also bench_flce's --check grid with the fused paths forced on")
    args = ap.parse_args()
    t0 = time.time()
    meta = bf.gpu_meta()
    meta["bf16_matmul_tflops"] = rate = bf.matmul_tflops()
    meta["bf16_matmul_tflops_sustained"] = bf.matmul_tflops_sustained()
    out = args.out.replace("{card}", card_key(meta["card"]))
    print("#", json.dumps(meta), flush=True)
    rows = [{"_meta": meta}]
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    for shape in shapes:
        rows += phases(shape)
        torch.cuda.empty_cache()
        dump_json(out, rows)
    real_make_impl = bf.make_impl
    for ignore in (0.25, "check", 0.0, 0.5):
        if ignore == "check":
            check_fused(args, meta, rows, out, t0)
            continue
        names = args.variants if ignore == 0.25 else args.small_variants
        for shape in shapes:
            ref = None
            for name in names.split(","):
                if time.time() - t0 > args.deadline:
                    rows.append({"impl": name, "shape": list(shape), "ignored_frac": ignore, "skipped": "deadline"})
                    continue
                backend = set_variant("fast" if name == "liger" else name)
                if ref is None:
                    ref = bf.reference(*bf.make_inputs(*shape, ignore=ignore))
                bf.make_impl = lambda _n, b=backend: real_make_impl("project" if b == "triton" else "project_fast")
                if name == "liger":
                    bf.make_impl = real_make_impl
                row = bf.bench_impl(name, shape, rate, 10, 3, ref, ignore)
                row["variant"] = VARIANTS.get(name, ("liger",))[1:]
                rows.append(row)
                print(json.dumps(row), flush=True)
                dump_json(out, rows)
            del ref
            torch.cuda.empty_cache()
    set_variant("fast")
    print(f"{'phase / impl':22s} {'shape':22s} {'ign':>4s} {'ms':>8s} {'TF/s|x_v':>8s} {'MiB':>6s} {'dx':>8s} {'dw':>8s}")
    for r in rows[1:]:
        if "check_rules" in r:
            print("check:", json.dumps(r)[:600])
            continue
        shape = "x".join(map(str, r.get("shape", [])))
        if "phase" in r:
            print(f"{r['phase']:22s} {shape:22s} {'':4s} {r.get('ms', float('nan')):8.3f} "
                  f"{r.get('tflops', r.get('max_abs_diff', float('nan'))):8.1f} {r.get('error', '')[:60]}")
        elif "ms" in r:
            print(f"{r['impl']:22s} {shape:22s} {r['ignored_frac']:4.2f} {r['ms']:8.2f} {r['x_valid_floor']:8.3f} "
                  f"{r['peak_extra_mib']:6.0f} {r['err_dx']:8.1e} {r['err_dw']:8.1e}")
        else:
            print(f"{r['impl']:22s} {shape:22s} {r.get('error', r.get('skipped', '?'))[:80]}")


if __name__ == "__main__":
    main()
