"""Fused linear cross-entropy on one GPU: ours against torch, torch.compile, Liger and Cut Cross-Entropy.

One run measures, at each shape (bf16, 25% ignored labels): forward+backward time (CUDA events,
warm-up, median), peak extra memory, and each implementation's loss / dX / dW error against an
fp32 reference computed from the same bf16 inputs; plus the bf16 matmul rate of this card in the
same run, which sets the floor ``6 N H V / rate``. Prints a table, writes JSON.

    python bench/bench_flce.py --out bench/results/h200.json
    python bench/bench_flce.py --check        # real-size correctness of our kernel (float64 reference)

Memory: ``peak_extra_mib`` is the peak allocated during forward+backward above what was allocated
before (inputs), *minus the two gradients every implementation must return* (dX and dW in the
input dtype); ``peak_total_extra_mib`` keeps them in.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(8192, 4096, 128256), (16384, 4096, 128256), (16384, 3584, 152064)]
IMPLS = ["project", "project_fast", "liger", "cce", "torch", "torch_compile"]
MIB = 1024 * 1024


# --------------------------------------------------------------------------- implementations
def _torch_loss(h, w, y):
    return torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)


_compiled = None


def make_impl(name):
    if name == "project":
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend="triton")
    if name == "project_fast":
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend="triton_fast")
    if name == "torch":
        return _torch_loss
    if name == "torch_compile":
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(_torch_loss, dynamic=False)
        return _compiled
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda h, w, y: mod(w, h, y)
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=-100)
    raise ValueError(name)


# --------------------------------------------------------------------------- helpers
def matmul_tflops(n=8192, reps=10):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def make_inputs(n, h, v, seed=0, dtype=torch.bfloat16, ignore=0.25):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g, dtype=torch.float32) * (2.0 / math.sqrt(h))).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < ignore] = -100
    return hidden, weight, y


def reference(hidden, weight, y, dtype=torch.float32, chunk=2048, softcap=None):
    """Loss and grads in ``dtype`` from the (upcast) inputs, chunked so any shape fits."""
    w = weight.detach().to(dtype).requires_grad_()
    dh = torch.empty(hidden.shape, device=hidden.device, dtype=dtype)
    n_valid = max(int((y != -100).sum()), 1)
    total = 0.0
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s : s + chunk].detach().to(dtype).requires_grad_()
        z = h @ w.t()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        loss = torch.nn.functional.cross_entropy(z, y[s : s + chunk], ignore_index=-100, reduction="sum") / n_valid
        loss.backward()
        dh[s : s + chunk] = h.grad
        total += float(loss)
    return total, dh, w.grad


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_once(fn, h, w, y):
    h.grad = None
    w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss


def bench_impl(name, shape, rate, reps, warmup, ref):
    n, hd, v = shape
    hidden, weight, y = make_inputs(n, hd, v)
    ref_loss, ref_dh, ref_dw = ref
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    fn = make_impl(name)
    row = {"impl": name, "N": n, "H": hd, "V": v, "floor_ms": 6 * n * hd * v / (rate * 1e12) * 1e3}
    try:
        loss = run_once(fn, h, w, y)  # compile / autotune
        torch.cuda.synchronize()
        row["err_loss"] = abs(float(loss) - ref_loss) / abs(ref_loss)
        row["err_dx"] = rel(h.grad, ref_dh)
        row["err_dw"] = rel(w.grad, ref_dw)
        for _ in range(warmup):
            run_once(fn, h, w, y)
        times = []
        for _ in range(reps):
            h.grad = None
            w.grad = None
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            loss = fn(h, w, y)
            loss.backward()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        row["ms"] = statistics.median(times)
        row["ms_min"] = min(times)
        h.grad = None
        w.grad = None
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
    except Exception as exc:  # an implementation that fails is reported, not hidden
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    del h, w, hidden, weight
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------- correctness at real sizes
CHECKS = [
    # (N, H, V, dtype, softcap, ignore)
    (4096, 896, 151936, torch.bfloat16, None, 0.25),
    (2048, 8192, 32000, torch.bfloat16, None, 0.25),
    (4096, 4096, 128256, torch.bfloat16, None, 0.25),
    (2048, 2304, 256000, torch.bfloat16, 30.0, 0.25),
    (3001, 3584, 152064, torch.float16, None, 0.1),
    (1500, 4096, 128256, torch.float32, None, 0.25),
    (1024, 4096, 128256, torch.bfloat16, None, 1.0),
]


def check(out_rows):
    from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

    for (n, hd, v, dtype, softcap, ignore), backend in [(c, b) for c in CHECKS for b in ("triton", "triton_fast")]:
        hidden, weight, y = make_inputs(n, hd, v, seed=1, dtype=dtype, ignore=ignore)
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w, y, softcap=softcap, backend=backend)
        loss.backward()
        first = (float(loss), h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
        loss2 = fused_linear_cross_entropy(h, w, y, softcap=softcap, backend=backend)
        loss2.backward()
        deterministic = float(loss2) == first[0] and torch.equal(h.grad, first[1]) and torch.equal(w.grad, first[2])
        row = {"backend": backend, "N": n, "H": hd, "V": v, "dtype": str(dtype).split(".")[-1], "softcap": softcap, "ignore": ignore,
               "finite": bool(torch.isfinite(loss)), "deterministic": deterministic}
        if ignore < 1.0:
            ref_loss, ref_dh, ref_dw = reference(hidden, weight, y, dtype=torch.float64, chunk=1024, softcap=softcap)
            row.update(err_loss=abs(first[0] - ref_loss) / abs(ref_loss), err_dx=rel(first[1], ref_dh), err_dw=rel(first[2], ref_dw))
            if dtype != torch.float32:  # what plain torch in the same dtype gets
                hh = hidden.clone().requires_grad_()
                ww = weight.clone().requires_grad_()
                for s in range(0, n, 1024):
                    z = (hh[s : s + 1024] @ ww.t()).float()
                    if softcap is not None:
                        z = softcap * torch.tanh(z / softcap)
                    (torch.nn.functional.cross_entropy(z, y[s : s + 1024], ignore_index=-100, reduction="sum")
                     / max(int((y != -100).sum()), 1)).backward()
                row.update(torch_err_dx=rel(hh.grad, ref_dh), torch_err_dw=rel(ww.grad, ref_dw))
                del hh, ww
            del ref_dh, ref_dw
        else:
            row.update(loss=first[0], grads_zero=bool((first[1] == 0).all() and (first[2] == 0).all()))
        out_rows.append(row)
        print("check", json.dumps(row), flush=True)
        del h, w, hidden, weight, first
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200.json")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="real-size correctness of our kernel only")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = {
        "card": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for mod in ("triton", "liger_kernel", "cut_cross_entropy", "transformers"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            from importlib.metadata import version

            try:
                meta[mod] = version(mod.replace("_", "-"))
            except Exception:
                meta[mod] = None
    if args.check:
        rows = []
        check(rows)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "checks": rows}, f, indent=1)
        return
    rate = matmul_tflops()
    meta["bf16_matmul_tflops"] = rate
    print(f"# {meta}", flush=True)
    rows = []
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    for shape in shapes:
        ref = reference(*make_inputs(*shape))
        for name in args.impls.split(","):
            row = bench_impl(name, shape, rate, args.reps, args.warmup, ref)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ref
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    with open(args.out.replace(".json", "_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"\n{'impl':14s} {'N x H x V':22s} {'ms':>8s} {'floor':>7s} {'x':>5s} {'MiB':>8s} {'MiB+g':>8s} {'err_dx':>8s} {'err_dw':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:14s} {r['N']}x{r['H']}x{r['V']}  ERROR {r['error'][:80]}")
            continue
        print(
            f"{r['impl']:14s} {str(r['N']) + 'x' + str(r['H']) + 'x' + str(r['V']):22s} {r['ms']:8.2f} {r['floor_ms']:7.2f} "
            f"{r['x_floor']:5.2f} {r['peak_extra_mib']:8.0f} {r['peak_total_extra_mib']:8.0f} {r['err_dx']:8.1e} {r['err_dw']:8.1e}"
        )


if __name__ == "__main__":
    main()
