"""Fused linear cross-entropy on one GPU, forward + backward: the plugin's two kernels against Liger (on request the
unfused torch loss and ``torch_chunked``, TRL's / LLaMA-Factory's chunked loss), rows to JSON one by one. Per shape
and ignored-label fraction (bf16): ms, peak memory beyond the inputs (``peak_extra_mib`` without dX, dW), errors
against an fp32 reference and ``x_valid_floor`` (ms over 6 N_valid H V flops at the bf16 matmul rate measured in the
run). ``--check``: every backend against float64 beside plain torch and the rounding floor, at real sizes.
``--table`` prints --out's table; ``{card}`` in --out: h200, h100, ... Commands, fields, findings: bench/RESULTS.md 1.
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

from common import card_key, dump_json, load_rows, versions
from llamafactory_liger_fsdp.testing import rel

MIB = 1024 * 1024
SHAPES = "8192,4096,128256;16384,4096,128256;16384,3584,152064;32768,4096,128256;8192,8192,128256;8192,3840,262208"
IMPLS = ["project", "project_fast", "liger", "torch", "torch_chunked"]  # project: the lean `triton` backend
TORCH_CHUNK = 4096
T0 = time.time()


# --------------------------------------------------------------------------- implementations
def chunk_step(h, w, y, scale):
    """One chunk of the torch chunked loss: logits upcast to fp32 (the model's GEMM), the CE summed over valid rows,
    dz = (softmax - onehot) x ``scale`` in the inputs' dtype, and the chunk's dX and dW."""
    z = (h @ w.t()).float()
    t, valid = y.clamp(min=0)[:, None], (y != -100).float()
    lse = torch.logsumexp(z, -1)
    dz = torch.exp(z - lse[:, None]).scatter_add(1, t, -torch.ones_like(z[:, :1])) * (valid * scale)[:, None]
    dz = dz.to(h.dtype)
    return ((lse - z.gather(1, t)[:, 0]) * valid).sum(), dz @ w, dz.t() @ h


class TorchChunked(torch.autograd.Function):
    """TRL's / LLaMA-Factory's chunked loss: gradients in the forward, TORCH_CHUNK rows at a time (the step under
    torch.compile, dynamic=False), dW summed in the weight's dtype; backward scales them by the incoming gradient."""

    step = staticmethod(chunk_step)

    @staticmethod
    def forward(ctx, h, w, y):
        scale = 1.0 / (y != -100).sum().clamp(min=1)
        loss, dh, dw = 0.0, torch.empty_like(h), torch.zeros_like(w)
        for s in range(0, h.shape[0], TORCH_CHUNK):
            rows = slice(s, s + TORCH_CHUNK)
            part, dh[rows], dw_part = TorchChunked.step(h[rows], w, y[rows], scale)
            loss = loss + part
            dw += dw_part
        ctx.save_for_backward(dh, dw)
        return loss * scale

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        return dh * g, dw * g, None


def make_impl(name):
    if name in ("project", "project_fast"):
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy
        backend = "triton" if name == "project" else "triton_fast"
        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend=backend)
    if name == "torch":
        return lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)
    if name == "torch_chunked":
        torch._dynamo.reset()  # a fresh recompile budget for this shape's two chunk sizes
        TorchChunked.step = staticmethod(torch.compile(chunk_step, dynamic=False))
        return TorchChunked.apply
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        mod = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda h, w, y: mod(w, h, y)
    raise ValueError(name)


# --------------------------------------------------------------------------- helpers
def gpu_meta() -> dict:
    """The run's ``_meta`` fields: card (torch's name of GPU 0), date and versions."""
    return {"card": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "python": platform.python_version(), **versions(("triton", "liger_kernel", "transformers"))}


def cuda_ms(fn, reps, warmup=0, fresh=False) -> list:
    """ms of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones (CUDA events, synchronised after each);
    ``fresh``: the allocator's cache emptied and the peak reset before each."""
    times = []
    for i in range(warmup + reps):
        if fresh:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e)] if i >= warmup else []
    return times


def matmul_tflops(n=8192, burst=1, reps=10):
    """This card's bf16 TFLOP/s on an n^3 GEMM: median of ``reps`` timings of ``burst`` GEMMs back to back. burst 40:
    the sustained rate a fused kernel's GEMMs see (clocks drop under power limits)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 * burst / (statistics.median(cuda_ms(lambda: [a @ b for _ in range(burst)], reps, 3)) * 1e-3) / 1e12


def make_inputs(n, h, v, seed=0, dtype=None, ignore=0.25, scale=1.0):
    """Hidden states ``[n, h]`` (N(0, 1) x ``scale``), a head ``[v, h]`` (N(0, 4 / h)) in ``dtype`` (default bf16),
    labels with a fraction ``ignore`` set to -100; on the GPU, seeded."""
    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=g, dtype=torch.float32) * scale).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g, dtype=torch.float32) * (2.0 / math.sqrt(h))).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < ignore] = -100
    return hidden, weight, y


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
        c = None if grad_rows is None else grad_rows[s : s + chunk]
        scalar, loss = _ce(z, y[s : s + chunk], reduction, eps, c, n_valid)
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
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    n_valid = int((y != -100).sum())
    row = {"impl": name, "N": n, "H": hd, "V": v, "shape": [n, hd, v], "ignored_frac": ignore, "n_valid": n_valid,
           "matmul_tflops": rate, "floor_ms": 6 * n * hd * v / (rate * 1e12) * 1e3,
           "floor_valid_ms": 6 * n_valid * hd * v / (rate * 1e12) * 1e3}
    try:
        fn = make_impl(name)
        loss = run_once(fn, h, w, y)  # compile / autotune
        torch.cuda.synchronize()
        row.update(err_loss=abs(float(loss) - float(ref[0])) / abs(float(ref[0])), err_dx=rel(h.grad, ref[1]),
                   err_dw=rel(w.grad, ref[2]))
        times = cuda_ms(lambda: run_once(fn, h, w, y), reps, warmup)
        row.update(ms=statistics.median(times), ms_min=min(times))
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        cuda_ms(lambda: run_once(fn, h, w, y), 1, fresh=True)
        peak = torch.cuda.max_memory_allocated() - base
        grads = h.numel() * h.element_size() + w.numel() * w.element_size()
        row.update(peak_total_extra_mib=peak / MIB, peak_extra_mib=(peak - grads) / MIB,
                   x_floor=row["ms"] / row["floor_ms"], x_valid_floor=row["ms"] / row["floor_valid_ms"])
    except Exception as exc:  # an implementation that fails is reported, not hidden
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    h = w = hidden = weight = None  # freed before the next implementation's inputs
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


def _say(out_rows, out_path, row, tag="check"):
    out_rows.append(row)
    print(f"{tag} {json.dumps(row)}".strip(), flush=True)
    dump_json(out_path, out_rows)


def check(out_rows, out_path):
    from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy
    for n, hd, v, dtype, softcap, ignore, reduction, eps, scale in CHECKS:
        hidden, weight, y = make_inputs(n, hd, v, seed=1, dtype=dtype, ignore=ignore, scale=scale)
        gen = torch.Generator(device="cuda").manual_seed(3)  # reduction none: each row's incoming gradient
        g = torch.exp(torch.randn(n, device="cuda", generator=gen)) if reduction == "none" else None
        base = {"N": n, "H": hd, "V": v, "dtype": str(dtype).split(".")[-1], "softcap": softcap, "ignore": ignore,
                "reduction": reduction, "label_smoothing": eps, "hidden_scale": scale}
        ref = plain = None
        if ignore < 1.0:
            kw = dict(chunk=1024, softcap=softcap, reduction=reduction, eps=eps, grad_rows=g)
            ref = reference(hidden, weight, y, torch.float64, **kw)
            plain = reference(hidden, weight, y, plain=True, **kw)
            base.update(floor_dx=rel(ref[1].to(dtype), ref[1]), floor_dw=rel(ref[2].to(dtype), ref[2]), plain_dx=rel(
                plain[1], ref[1]), plain_dw=rel(plain[2], ref[2]), plain_loss=rel(plain[0], ref[0]))
        for backend in ("torch", "triton", "triton_fast"):
            row = dict(base, backend=backend)
            try:
                outs = []
                for _ in range(2):
                    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                    loss = fused_linear_cross_entropy(h, w, y, softcap=softcap, reduction=reduction,
                                                      label_smoothing=eps, backend=backend)
                    loss.backward(g)
                    outs.append((loss.detach(), h.grad, w.grad))
                    del h, w
                row["deterministic"] = all(torch.equal(a, b) for a, b in zip(*outs))
                loss, dh, dw = outs[0]
                row["finite"] = bool(torch.isfinite(loss).all())
                if ref is not None:
                    row.update(err_loss=rel(loss, ref[0]), err_dx=rel(dh, ref[1]), err_dw=rel(dw, ref[2]))
                    if dtype != torch.float32 or scale != 1.0:
                        row.update({f"x_plain_{k}": row[f"err_{k}"] / base[f"plain_{k}"] for k in ("dx", "dw")})
                else:
                    row.update(loss=float(loss.sum()), grads_zero=bool((dh == 0).all() and (dw == 0).all()))
                del outs, loss, dh, dw
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            _say(out_rows, out_path, row)
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
        _say(out_rows, out_path, {"check": "bad_label", "backend": backend, "message": msg[:200], "after": ok})
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for backend in ("triton", "triton_fast"):  # the forward alone, with and without autograd: time and peak
        for mode in ("no_grad", "grad"):
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            with torch.set_grad_enabled(mode == "grad"):
                times = cuda_ms(lambda: fused_linear_cross_entropy(h, w, y, backend=backend), 5, 1, fresh=True)
            _say(out_rows, out_path, {"check": "forward_only", "backend": backend, "mode": mode, "N": y.numel(),
                                      "H": h.shape[1], "V": w.shape[0], "forward_ms": statistics.median(times),
                                      "forward_peak_mib": (torch.cuda.max_memory_allocated() - base) / MIB})


# --------------------------------------------------------------------------- the sweep and its table
def sweep(args, shapes, rate, sustained, out) -> list:
    """Each shape and ignored fraction: a row per implementation, to ``out``; the rows."""
    rows = []
    for shape, ignore in ((s, float(i)) for s in shapes for i in args.ignored.split(",")):
        ref = None
        for name in args.impls.split(","):
            if time.time() - T0 > args.deadline:
                row = {"impl": name, "N": shape[0], "H": shape[1], "V": shape[2], "shape": list(shape),
                       "ignored_frac": ignore, "skipped": "deadline"}
            else:
                ref = ref or reference(*make_inputs(*shape, ignore=ignore))
                row = bench_impl(name, shape, rate, args.reps, args.warmup, ref, ignore)
                if "ms" in row:  # the same ratio against the sustained rate (not the definition)
                    row["matmul_tflops_sustained"] = sustained
                    row["x_valid_floor_sustained"] = row["ms"] / (row["floor_valid_ms"] * rate / sustained)
            _say(rows, out, row, "")
        del ref
        torch.cuda.empty_cache()
    return rows


def table(rows) -> None:
    """Per shape and ignored fraction, each implementation's ms, floor, memory and errors."""
    print(f"{'impl':14s} {'N x H x V':22s} {'ign':>4s} {'ms':>8s} {'floor_v':>7s} {'x_v':>5s} {'x_v sust':>8s} "
          f"{'MiB':>6s} {'MiB+g':>6s} {'err_dx':>8s} {'err_dw':>8s}")
    for r in rows:
        shape = "x".join(map(str, r.get("shape", [])))
        if "impl" in r and "ms" not in r:
            print(f"{r['impl']:14s} {shape:22s} {r.get('error', r.get('skipped', '?'))[:80]}")
        elif "impl" in r:
            print(f"{r['impl']:14s} {shape:22s} {r['ignored_frac']:4.2f} {r['ms']:8.2f} {r['floor_valid_ms']:7.2f} "
                  f"{r['x_valid_floor']:5.2f} {r.get('x_valid_floor_sustained', math.nan):8.2f} "
                  f"{r['peak_extra_mib']:6.0f} {r['peak_total_extra_mib']:6.0f} {r['err_dx']:8.1e} {r['err_dw']:8.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the rows' JSON (default bench/results/{card}_kernel3.json; "
                    "--check: {card}_kernel3_check.json)")
    ap.add_argument("--impls", default="project_fast,project,liger", help=f"comma list of {','.join(IMPLS)}")
    ap.add_argument("--shapes", default=SHAPES, help="N,H,V;...")
    ap.add_argument("--ignored", default="0,0.25,0.5", help="comma list of ignored-label fractions")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from the start; what is left is skipped")
    ap.add_argument("--check", action="store_true", help="real-size correctness of every backend")
    ap.add_argument("--table", action="store_true", help="print the table of --out; run nothing")
    args = ap.parse_args()
    kind = "_kernel3_check" if args.check else "_kernel3"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "{card}" + kind + ".json")
    if args.table:
        return table(load_rows(out))
    meta = gpu_meta()
    out = out.replace("{card}", card_key(meta["card"]))
    if args.check:
        rows = []
        check(rows, out)
        return dump_json(out, {"meta": meta, "checks": rows})
    meta["bf16_matmul_tflops"] = rate = matmul_tflops()
    meta["bf16_matmul_tflops_sustained"] = sustained = matmul_tflops(burst=40, reps=1)
    print(f"# {json.dumps(meta)}", flush=True)
    dump_json(out.replace(".json", "_meta.json"), meta)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    table(sweep(args, shapes, rate, sustained, out))


if __name__ == "__main__":
    main()
