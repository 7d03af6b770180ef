"""Fused linear cross-entropy on one GPU, forward + backward: the plugin's two kernels against Liger (on request the
unfused torch loss and ``torch_chunked``, TRL's / LLaMA-Factory's chunked loss). Rows to JSON one by one.

Benchmark (default), per shape and ignored-label fraction (bf16): ms (CUDA events, 3 warm-ups, median of 10), peak
memory beyond the inputs (``peak_extra_mib`` without the dX, dW every implementation returns, ``peak_total_extra_mib``
with them), loss / dX / dW error against an fp32 reference from the same inputs, and ``x_valid_floor`` = ms over
6 N_valid H V flops at the card's bf16 matmul rate measured in the run (short bursts; ``_sustained``: back to back).
``--check``: real-size correctness of every backend against float64 beside plain torch and the rounding floor
(reductions, label smoothing, softcap, fp16, fp32, large logits, determinism, bad labels, the forward alone).
``--variants``: issue 50's A/B of the fused logits GEMM (ops/triton_fused.py): the phases of one 3072-row chunk per
shape, then the benchmark per ``VARIANTS`` entry at 25% ignored, ``--check-out``'s grid with the fused paths forced
on, ``--small-variants`` at 0% / 50%. ``--table`` prints --out's table; ``{card}`` in --out: h200, h100, ...

    python bench/bench_flce.py [--out bench/results/{card}_kernel3.json] [--deadline 290] [--impls ...,torch_chunked]
    python bench/bench_flce.py --check [--out bench/results/{card}_kernel3_check.json]
    python bench/bench_flce.py --variants all|fast,lean,... [--check-out F] [--out {card}_kernel4_variants.json]
    python bench/bench_flce.py --table --out bench/results/h200_kernel3.json
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
BIG = 1 << 30
VARIANTS = {  # --variants: name -> (backend, triton_fused.RULES, FAST_CHUNK_ROWS, RECOMPUTE_ROWS_X)
    "fast": ("triton_fast", [], 3072, 2), "fast_c6k": ("triton_fast", [], 6144, 2),
    "fast_stats": ("triton_fast", [(BIG, "stats", False)], 3072, 2),
    "fast_rec": ("triton_fast", [(BIG, "recompute", False)], 3072, 2),
    "fast_rec_x4": ("triton_fast", [(BIG, "recompute", False)], 3072, 4),
    "lean": ("triton", [], 3072, 2), "lean_fused": ("triton", [(BIG, None, True)], 3072, 2),
}
VARIANT_SHAPES = "16384,896,151936;16384,1152,262144;16384,2048,151936;16384,4096,128256"
TORCH_CHUNK = 4096
T0 = time.time()
DEFAULTS = []  # the ops' own constants, before any variant set them


# --------------------------------------------------------------------------- implementations
def set_variant(name):
    """The ops' constants of variant ``name`` (None: their own); the backend to call."""
    from llamafactory_liger_fsdp.ops import triton_common as tc
    from llamafactory_liger_fsdp.ops import triton_fused as tf

    DEFAULTS[:] = DEFAULTS or [(None, tf.RULES, tc.FAST_CHUNK_ROWS, tf.RECOMPUTE_ROWS_X)]
    backend, tf.RULES, tc.FAST_CHUNK_ROWS, tf.RECOMPUTE_ROWS_X = VARIANTS[name] if name else DEFAULTS[0]
    return backend


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
    if name in ("project", "project_fast") or name in VARIANTS:
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

        backend = set_variant(name if name in VARIANTS else None) or {"project": "triton"}.get(name, "triton_fast")
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
    """The run's ``_meta`` fields: card (torch's name of GPU 0), date, torch, python, and triton / liger_kernel /
    transformers (None when absent)."""
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
    """This card's bf16 rate on an n^3 GEMM, TFLOP/s: median of ``reps`` timings of ``burst`` GEMMs back to back after
    3 warm-ups. burst 40 (~60 ms, no sync between): the sustained rate a fused kernel's GEMMs see (clocks drop under
    power limits), beside the short bursts'."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 * burst / (statistics.median(cuda_ms(lambda: [a @ b for _ in range(burst)], reps, 3)) * 1e-3) / 1e12


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
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    n_valid = int((y != -100).sum())
    row = {"impl": name, "N": n, "H": hd, "V": v, "shape": [n, hd, v], "ignored_frac": ignore, "n_valid": n_valid,
           "matmul_tflops": rate, "floor_ms": 6 * n * hd * v / (rate * 1e12) * 1e3,
           "floor_valid_ms": 6 * n_valid * hd * v / (rate * 1e12) * 1e3}
    if name in VARIANTS:
        row["variant"] = list(VARIANTS[name][1:])
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
        g = None
        if reduction == "none":
            g = torch.exp(torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)))
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
                    loss.backward(g if reduction == "none" else None)
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


# --------------------------------------------------------------------------- --variants: issue 50's A/B
def phases(shape, c=3072):
    """ms of each step of one c-row chunk (triton.testing.do_bench, median, L2 flushed between runs)."""
    import triton

    from llamafactory_liger_fsdp.ops import triton_common as tc
    from llamafactory_liger_fsdp.ops import triton_fused as tf
    from llamafactory_liger_fsdp.ops import triton_kernels as tk

    _, hd, v = shape
    h, w, y = make_inputs(c, hd, v, ignore=0.0)
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

    def fused(epi, ws):
        tf.CONFIG = tf.CONFIG[:6] + (ws,)
        if epi == 2:
            return tf.logits_dz(h, w, dz16, m, inv_s, None, 0.0, v, 1.0)
        return tf.logits_stats(h, w, y, None, 0.0, z_out=z if epi == 1 else None)

    for ws, tag in ((True, ""), (False, "_nows")):
        for epi, name in enumerate(("fused_stats", "fused_stats_z", "fused_dz")):
            steps[name + tag] = lambda e=epi, ws=ws: fused(e, ws)
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


def check_fused(args, card, rows, out):
    """The --check grid with the fused paths forced on (rows to --check-out), a summary row to ``rows``."""
    if args.check_out and time.time() - T0 < args.deadline:
        from llamafactory_liger_fsdp.ops import triton_fused

        triton_fused.RULES, checks = [(BIG, "recompute", True)], []
        check(checks, args.check_out.replace("{card}", card_key(card)))
        worst = [max(c["err_dx"] / c["floor_dx"], c["err_dw"] / c["floor_dw"]) for c in checks if "err_dx" in c
                 and c.get("floor_dx") and c["backend"] != "torch" and c["dtype"] != "float32"]
        _say(rows, out, {"check_rules": triton_fused.RULES, "n_checks": len(checks), "worst_x_floor": max(
            worst, default=None), "errors": [c for c in checks if "error" in c][:3]}, "check summary")


# --------------------------------------------------------------------------- the sweep and its table
def sweep(args, cases, rate, sustained, rows, out):
    """Each (shape, ignored fraction, implementations) of ``cases``: a row per implementation, to ``out``."""
    for shape, ignore, names in cases:
        ref = None
        for name in names.split(","):
            if time.time() - T0 > args.deadline:
                row = {"impl": name, "N": shape[0], "H": shape[1], "V": shape[2], "shape": list(shape),
                       "ignored_frac": ignore, "skipped": "deadline"}
            else:
                ref = ref or reference(*make_inputs(*shape, ignore=ignore))
                row = bench_impl(name, shape, rate, args.reps, args.warmup, ref, ignore)
                if "ms" in row:  # the same ratio against the sustained rate (not the issue's definition)
                    row["matmul_tflops_sustained"] = sustained
                    row["x_valid_floor_sustained"] = row["ms"] / (row["floor_valid_ms"] * rate / sustained)
            _say(rows, out, row, "")
        del ref
        torch.cuda.empty_cache()


def table(rows) -> None:
    """Per shape and ignored fraction, each implementation's ms, floor, memory and errors (--variants: the phases)."""
    print(f"{'impl':14s} {'N x H x V':22s} {'ign':>4s} {'ms':>8s} {'floor_v':>7s} {'x_v':>5s} {'x_v sust':>8s} "
          f"{'MiB':>6s} {'MiB+g':>6s} {'err_dx':>8s} {'err_dw':>8s}")
    for r in rows:
        shape = "x".join(map(str, r.get("shape", [])))
        if "phase" in r:
            print(f"{r['phase']:23s} {shape:22s} {r.get('ms', math.nan):8.3f} ms "
                  f"{r.get('tflops', r.get('max_abs_diff', math.nan)):8.1f} {r.get('error', '')[:60]}")
        elif "check_rules" in r:
            print("check:", json.dumps(r)[:600])
        elif "impl" in r and "ms" not in r:
            print(f"{r['impl']:14s} {shape:22s} {r.get('error', r.get('skipped', '?'))[:80]}")
        elif "impl" in r:
            print(f"{r['impl']:14s} {shape:22s} {r['ignored_frac']:4.2f} {r['ms']:8.2f} {r['floor_valid_ms']:7.2f} "
                  f"{r['x_valid_floor']:5.2f} {r.get('x_valid_floor_sustained', math.nan):8.2f} "
                  f"{r['peak_extra_mib']:6.0f} {r['peak_total_extra_mib']:6.0f} {r['err_dx']:8.1e} {r['err_dw']:8.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the rows' JSON (default bench/results/{card}_kernel3.json; "
                    "--check: {card}_kernel3_check.json; --variants: {card}_kernel4_variants.json)")
    ap.add_argument("--impls", default="project_fast,project,liger", help=f"of {','.join(IMPLS)} and VARIANTS")
    ap.add_argument("--shapes", default=None, help=f"N,H,V;... (default {SHAPES}; --variants: {VARIANT_SHAPES})")
    ap.add_argument("--ignored", default="0,0.25,0.5", help="comma list of ignored-label fractions")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from the start; what is left is skipped")
    ap.add_argument("--check", action="store_true", help="real-size correctness of every backend")
    ap.add_argument("--variants", default=None, help=f"issue 50's A/B of these (of {','.join(VARIANTS)},liger; all: "
                    "every one) at 25%% ignored, after the phases of one chunk at each shape")
    ap.add_argument("--small-variants", default="fast,fast_stats,fast_rec,lean,lean_fused",
                    help="--variants: then these at 0%% / 50%% ignored")
    ap.add_argument("--check-out", default=None, help="--variants: also the --check grid with the fused paths forced "
                    "on, rows to this JSON (after the 25%% rows)")
    ap.add_argument("--table", action="store_true", help="print the table of --out; run nothing")
    args = ap.parse_args()
    args.variants = ",".join([*VARIANTS, "liger"]) if args.variants == "all" else args.variants
    kind = "_kernel4_variants" if args.variants else "_kernel3_check" if args.check else "_kernel3"
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
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shapes or (VARIANT_SHAPES if args.variants else
                                                                            SHAPES)).split(";")]
    if not args.variants:
        dump_json(out.replace(".json", "_meta.json"), meta)
        rows = []
        sweep(args, [(s, float(i), args.impls) for s in shapes for i in args.ignored.split(",")], rate, sustained, rows,
              out)
        return table(rows)
    rows = [{"_meta": meta}]
    for shape in shapes:
        rows += phases(shape)
        torch.cuda.empty_cache()
        dump_json(out, rows)
    sweep(args, [(s, 0.25, args.variants) for s in shapes], rate, sustained, rows, out)
    check_fused(args, meta["card"], rows, out)
    sweep(args, [(s, i, args.small_variants) for i in (0.0, 0.5) for s in shapes], rate, sustained, rows, out)
    table(rows[1:])


if __name__ == "__main__":
    main()
