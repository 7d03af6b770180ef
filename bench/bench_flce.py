"""Fused linear cross-entropy on one GPU: the plugin's two kernels against Liger (and the unfused torch loss on
request), forward + backward.

Benchmark (default): at each shape and fraction of ignored labels (bf16), time (CUDA events, 3 warm-ups, median of
10), peak memory beyond the inputs, and each implementation's loss / dX / dW error against an fp32 reference from the
same bf16 inputs; the card's bf16 matmul rate is measured in the same run (short bursts and sustained), which sets the
floors ``floor_ms = 6 N H V / rate`` and ``floor_valid_ms = 6 N_valid H V / rate`` (the rows a kernel that skips
ignored labels multiplies); ``x_valid_floor`` = ms / floor_valid_ms. ``peak_extra_mib`` leaves out the two gradients
every implementation returns (dX, dW in the input dtype); ``peak_total_extra_mib`` keeps them. ``--check``: real-size
correctness of every backend against float64 (plain torch in the same dtype and the rounding floor beside it),
reductions, label smoothing, softcap, fp16, fp32, large logits, determinism, bad labels, the forward-only path.
Both write JSON row by row; ``--table`` prints the benchmark's table from --out.

    python bench/bench_flce.py [--out bench/results/{card}_kernel3.json] [--deadline 290]
    python bench/bench_flce.py --check [--out bench/results/{card}_kernel3_check.json]
    python bench/bench_flce.py --table --out bench/results/h200_kernel3.json

``{card}`` in --out is the card's short name (h200, h100, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

from common import card_key, dump_json, load_rows
from llamafactory_liger_fsdp.testing import rel

MIB = 1024 * 1024

SHAPES = [
    (8192, 4096, 128256), (16384, 4096, 128256), (16384, 3584, 152064),
    (32768, 4096, 128256), (8192, 8192, 128256), (8192, 3840, 262208),
]
IMPLS = ["project", "project_fast", "liger", "torch"]  # project: the lean `triton` backend
T0 = time.time()


# --------------------------------------------------------------------------- implementations
def make_impl(name):
    if name in ("project", "project_fast"):
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

        backend = "triton" if name == "project" else "triton_fast"
        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend=backend)
    if name == "torch":
        return lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda h, w, y: mod(w, h, y)
    raise ValueError(name)


# --------------------------------------------------------------------------- helpers
def gpu_meta() -> dict:
    """The run's ``_meta`` fields: card (torch's name of GPU 0), date, torch, python, and triton / liger_kernel /
    transformers (None when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    meta = {"card": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "python": platform.python_version()}
    for dist in ("triton", "liger-kernel", "transformers"):
        try:
            meta[dist.replace("-", "_")] = version(dist)
        except PackageNotFoundError:
            meta[dist.replace("-", "_")] = None
    return meta


def matmul_tflops(n=8192, reps=10):
    """This card's bf16 matmul rate (n^3 GEMM, 3 warm-ups, median of ``reps`` short bursts), TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e)] if i >= 3 else []
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def make_inputs(n, h, v, seed=0, dtype=None, ignore=0.25, scale=1.0):
    """Hidden states ``[n, h]`` (N(0, 1) x ``scale``), a head ``[v, h]`` (N(0, 4 / h)), both in ``dtype`` (default
    bf16), and labels with a fraction ``ignore`` set to -100; on the GPU, from a generator seeded with ``seed``."""
    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=g, dtype=torch.float32) * scale).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g, dtype=torch.float32) * (2.0 / math.sqrt(h))).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < ignore] = -100
    return hidden, weight, y


def matmul_tflops_sustained(n=8192, reps=40):
    """The same GEMM back to back for ~60 ms (no sync between): the rate under the sustained load a fused kernel's
    GEMMs see (clocks drop under power limits), beside :func:`matmul_tflops`'s short bursts."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (s.elapsed_time(e) * 1e-3) / 1e12


def _ce(z, y, reduction, eps, grad_rows, n_valid):
    """The scalar to backpropagate: mean / sum / sum_i c_i loss_i, and the loss itself."""
    if reduction == "none":
        rows = torch.nn.functional.cross_entropy(z, y, ignore_index=-100, reduction="none", label_smoothing=eps)
        return (rows * grad_rows.to(rows.dtype)).sum(), rows.detach()
    s = torch.nn.functional.cross_entropy(z, y, ignore_index=-100, reduction="sum", label_smoothing=eps)
    if reduction == "mean":
        s = s / n_valid
    return s, s.detach()


def reference(hidden, weight, y, dtype=torch.float32, chunk=2048, softcap=None, reduction="mean", eps=0.0,
              grad_rows=None, plain=False):
    """Loss and grads, chunked so any shape fits. ``plain``: what the unfused model computes in the
    inputs' dtype (logits from one matmul in that dtype, fp32 loss); else everything in ``dtype``."""
    w = weight.detach().clone() if plain else weight.detach().to(dtype)
    w.requires_grad_()
    dh = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype if plain else dtype)
    n_valid = max(int((y != -100).sum()), 1)
    losses = []
    for s in range(0, hidden.shape[0], chunk):
        h = (hidden[s : s + chunk].detach().clone() if plain else hidden[s : s + chunk].detach().to(dtype))
        h.requires_grad_()
        z = (h @ w.t()).float() if plain else h @ w.t()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        scalar, loss = _ce(z, y[s : s + chunk], reduction, eps, None if grad_rows is None else grad_rows[s : s + chunk],
                           n_valid)
        scalar.backward()
        dh[s : s + chunk] = h.grad
        losses.append(loss.double())
    loss = torch.cat(losses) if reduction == "none" else sum(losses)
    return loss, dh, w.grad


def run_once(fn, h, w, y):
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss


def bench_impl(name, shape, rate, reps, warmup, ref, ignore=0.25):
    n, hd, v = shape
    hidden, weight, y = make_inputs(n, hd, v, ignore=ignore)
    ref_loss, ref_dh, ref_dw = ref
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    n_valid = int((y != -100).sum())
    row = {"impl": name, "N": n, "H": hd, "V": v, "shape": [n, hd, v], "ignored_frac": ignore, "n_valid": n_valid,
           "matmul_tflops": rate, "floor_ms": 6 * n * hd * v / (rate * 1e12) * 1e3,
           "floor_valid_ms": 6 * n_valid * hd * v / (rate * 1e12) * 1e3}
    try:
        fn = make_impl(name)
        loss = run_once(fn, h, w, y)  # compile / autotune
        torch.cuda.synchronize()
        row["err_loss"] = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
        row["err_dx"] = rel(h.grad, ref_dh)
        row["err_dw"] = rel(w.grad, ref_dw)
        for _ in range(warmup):
            run_once(fn, h, w, y)
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run_once(fn, h, w, y)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        row["ms"] = statistics.median(times)
        row["ms_min"] = min(times)
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_once(fn, h, w, y)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = h.numel() * h.element_size() + w.numel() * w.element_size()
        row["peak_total_extra_mib"] = peak / MIB
        row["peak_extra_mib"] = (peak - grads) / MIB
        row["x_floor"] = row["ms"] / row["floor_ms"]
        row["x_valid_floor"] = row["ms"] / row["floor_valid_ms"]
    except Exception as exc:  # an implementation that fails is reported, not hidden
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    del h, w, hidden, weight
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------- correctness at real sizes
CHECKS = [
    # (N, H, V, dtype, softcap, ignore, reduction, label_smoothing, hidden scale)
    (4096, 4096, 128256, torch.bfloat16, None, 0.25, "mean", 0.0, 1.0),
    (4096, 4096, 128256, torch.bfloat16, None, 0.25, "sum", 0.0, 1.0),
    (4096, 4096, 128256, torch.bfloat16, None, 0.25, "none", 0.0, 1.0),
    (4096, 4096, 128256, torch.bfloat16, None, 0.25, "mean", 0.1, 1.0),
    (4096, 896, 151936, torch.bfloat16, None, 0.25, "mean", 0.0, 1.0),
    (2048, 8192, 32000, torch.bfloat16, None, 0.25, "mean", 0.0, 1.0),
    (2048, 2304, 256000, torch.bfloat16, 30.0, 0.25, "mean", 0.0, 1.0),
    (3001, 3584, 152064, torch.float16, None, 0.1, "mean", 0.0, 1.0),
    (3001, 3584, 152064, torch.float16, None, 0.1, "none", 0.1, 1.0),
    (1500, 4096, 128256, torch.float32, None, 0.25, "mean", 0.0, 1.0),
    (1500, 4096, 32000, torch.float32, None, 0.25, "mean", 0.0, 100.0),  # large logits
    (1024, 4096, 128256, torch.bfloat16, None, 1.0, "mean", 0.0, 1.0),  # all ignored
]


def check(out_rows, out_path):
    from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

    for n, hd, v, dtype, softcap, ignore, reduction, eps, scale in CHECKS:
        hidden, weight, y = make_inputs(n, hd, v, seed=1, dtype=dtype, ignore=ignore, scale=scale)
        g = None
        if reduction == "none":
            g = torch.exp(torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)))
        base = {"N": n, "H": hd, "V": v, "dtype": str(dtype).split(".")[-1], "softcap": softcap, "ignore": ignore,
                "reduction": reduction, "label_smoothing": eps, "hidden_scale": scale}
        ref = plain = None
        if ignore < 1.0:
            ref = reference(hidden, weight, y, dtype=torch.float64, chunk=1024, softcap=softcap, reduction=reduction,
                            eps=eps, grad_rows=g)
            plain = reference(hidden, weight, y, chunk=1024, softcap=softcap, reduction=reduction, eps=eps, grad_rows=g,
                              plain=True)
            base.update(
                floor_dx=rel(ref[1].to(dtype), ref[1]), floor_dw=rel(ref[2].to(dtype), ref[2]),
                plain_dx=rel(plain[1], ref[1]), plain_dw=rel(plain[2], ref[2]), plain_loss=rel(plain[0], ref[0]),
            )
        for backend in ("torch", "triton", "triton_fast"):
            row = dict(base, backend=backend)
            try:
                outs = []
                for _ in range(2):
                    h = hidden.clone().requires_grad_()
                    w = weight.clone().requires_grad_()
                    loss = fused_linear_cross_entropy(h, w, y, softcap=softcap, reduction=reduction,
                                                      label_smoothing=eps, backend=backend)
                    loss.backward(g if reduction == "none" else None)
                    outs.append((loss.detach(), h.grad, w.grad))
                    del h, w
                row["deterministic"] = all(torch.equal(a, b) for a, b in zip(*outs))
                loss, dh, dw = outs[0]
                row["finite"] = bool(torch.isfinite(loss).all())
                if ref is not None:
                    row.update(err_loss=rel(loss, ref[0]), err_dx=rel(dh, ref[1]), err_dw=rel(dw, ref[2]))
                    if dtype != torch.float32 or scale != 1.0:
                        row.update(x_plain_dx=row["err_dx"] / base["plain_dx"], x_plain_dw=row["err_dw"] / base["plain_dw"])
                else:
                    row.update(loss=float(loss.sum()), grads_zero=bool((dh == 0).all() and (dw == 0).all()))
                del outs, loss, dh, dw
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            out_rows.append(row)
            print("check", json.dumps(row), flush=True)
            dump_json(out_path, out_rows)
        del hidden, weight, ref, plain
        torch.cuda.empty_cache()
    _extra_checks(out_rows, out_path)


def _extra_checks(out_rows, out_path):
    """Bad labels (one Python error, CUDA still usable) and the forward-only path (time, memory)."""
    from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

    hidden, weight, y = make_inputs(8192, 4096, 128256, seed=2)
    for backend in ("torch", "triton", "triton_fast"):
        bad = y.clone()
        bad[100] = 128256
        try:
            fused_linear_cross_entropy(hidden, weight, bad, backend=backend)
            msg = "no error"
        except ValueError as exc:
            msg = str(exc)
        ok = float(fused_linear_cross_entropy(hidden, weight, y, backend=backend))  # context still usable
        row = {"check": "bad_label", "backend": backend, "message": msg[:200], "after": ok}
        out_rows.append(row)
        print("check", json.dumps(row), flush=True)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for backend in ("triton", "triton_fast"):  # the forward alone, with and without autograd: time and peak
        for mode in ("no_grad", "grad"):
            times = []
            for i in range(6):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                with torch.set_grad_enabled(mode == "grad"):
                    loss = fused_linear_cross_entropy(h, w, y, backend=backend)
                e.record()
                torch.cuda.synchronize()
                times += [s.elapsed_time(e)] if i else []
                peak = (torch.cuda.max_memory_allocated() - base) / MIB
                del loss
            row = {"check": "forward_only", "backend": backend, "mode": mode, "N": y.numel(), "H": h.shape[1],
                   "V": w.shape[0], "forward_ms": statistics.median(times), "forward_peak_mib": peak}
            out_rows.append(row)
            print("check", json.dumps(row), flush=True)
    dump_json(out_path, out_rows)


def table(rows) -> None:
    """The benchmark's rows: per shape and ignored fraction, each implementation's ms, floor, memory and errors."""
    print(f"{'impl':14s} {'N x H x V':22s} {'ign':>4s} {'ms':>8s} {'floor_v':>7s} {'x_v':>5s} {'x_v sust':>8s} "
          f"{'MiB':>6s} {'MiB+g':>6s} {'err_dx':>8s} {'err_dw':>8s}")
    for r in rows:
        shape = f"{r['N']}x{r['H']}x{r['V']}"
        if "ms" not in r:
            print(f"{r['impl']:14s} {shape:22s} {r.get('error', r.get('skipped', '?'))[:80]}")
            continue
        print(f"{r['impl']:14s} {shape:22s} {r['ignored_frac']:4.2f} {r['ms']:8.2f} {r['floor_valid_ms']:7.2f} "
              f"{r['x_valid_floor']:5.2f} {r.get('x_valid_floor_sustained', math.nan):8.2f} {r['peak_extra_mib']:6.0f} "
              f"{r['peak_total_extra_mib']:6.0f} {r['err_dx']:8.1e} {r['err_dw']:8.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the rows' JSON (default bench/results/{card}_kernel3.json; "
                    "--check: {card}_kernel3_check.json)")
    ap.add_argument("--impls", default="project_fast,project,liger", help=f"of {','.join(IMPLS)}")
    ap.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--ignored", default="0,0.25,0.5", help="comma list of ignored-label fractions")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from the start; what is left is skipped")
    ap.add_argument("--check", action="store_true", help="real-size correctness of every backend")
    ap.add_argument("--table", action="store_true", help="print the table of --out; run nothing")
    args = ap.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "{card}_kernel3" + ("_check" if args.check else "") + ".json")
    if args.table:
        return table(load_rows(out))
    meta = gpu_meta()
    out = out.replace("{card}", card_key(meta["card"]))
    if args.check:
        rows = []
        check(rows, out)
        dump_json(out, {"meta": meta, "checks": rows})
        return
    rate = matmul_tflops()
    meta["bf16_matmul_tflops"] = rate
    meta["bf16_matmul_tflops_sustained"] = sustained = matmul_tflops_sustained()
    print(f"# {meta}", flush=True)
    dump_json(out.replace(".json", "_meta.json"), meta)
    rows = []
    for shape in [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]:
        for ignore in (float(x) for x in args.ignored.split(",")):
            ref = None
            for name in args.impls.split(","):
                if time.time() - T0 > args.deadline:
                    row = {"impl": name, "N": shape[0], "H": shape[1], "V": shape[2], "shape": list(shape),
                           "ignored_frac": ignore, "skipped": "deadline"}
                else:
                    if ref is None:
                        ref = reference(*make_inputs(*shape, ignore=ignore))
                    row = bench_impl(name, shape, rate, args.reps, args.warmup, ref, ignore)
                    if "ms" in row:  # the same ratio against the sustained rate (not the definition)
                        row["matmul_tflops_sustained"] = sustained
                        row["x_valid_floor_sustained"] = row["ms"] / (row["floor_valid_ms"] * rate / sustained)
                rows.append(row)
                print(json.dumps(row), flush=True)
                dump_json(out, rows)
            del ref
            torch.cuda.empty_cache()
    table(rows)


if __name__ == "__main__":
    main()
