"""The LoRA head's loss on one GPU: lora_B differentiated alone (``frozen_weight``) against the whole ``[W | B]``.

A LoRA head computes ``h W^T + s (h A^T) B^T = [h | s h A^T] [W | B]^T``. Before, the kernel got the concatenation as
one trained weight and computed dW for all ``H + r`` columns (``2 N_v (H + r) V`` flops and a ``[V, H + r]`` fp32
accumulator) of which autograd kept ``r``; now ``W`` goes in as ``frozen_weight`` and only lora_B's columns are
differentiated (``2 N_v r V``). Per backend (``triton_fast``, lean ``triton``): forward+backward ms (CUDA events,
median), peak extra memory, and the gradients of ``h`` and ``B`` against a float64-logit reference; plus PEFT's
unfused computation (logits in bf16, fp32 loss) for scale. Rows to JSON.

    python bench/lora_head_kernel.py --out bench/results/h200_lora_head_kernel.json
"""

from __future__ import annotations

import argparse
import json

import torch

from common import MIB, cuda_ms, gpu_meta, matmul_tflops
from llamafactory_liger_fsdp.testing import rel


def inputs(n, hd, v, r, ignore, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hd, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, hd, device="cuda", generator=g) * 2 / hd**0.5).bfloat16()
    a = (torch.randn(r, hd, device="cuda", generator=g) / hd**0.5).bfloat16()
    b = (torch.randn(v, r, device="cuda", generator=g) * 0.05).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < ignore] = -100
    return h, w, a, b, y


def make(variant, backend, scale):
    from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

    def fn(h, w, a, b, y):
        u = (h @ a.t()) * scale
        if variant == "peft_unfused":
            z = (h @ w.t() + u @ b.t()).float()
            return torch.nn.functional.cross_entropy(z, y, ignore_index=-100)
        hcat = torch.cat([h, u], dim=1)
        if variant == "whole":  # before: the concatenation is the trained weight
            return fused_linear_cross_entropy(hcat, torch.cat([w, b], dim=1), y, backend=backend)
        return fused_linear_cross_entropy(hcat, b, y, backend=backend, frozen_weight=w)
    return fn


def reference(h, w, a, b, y, scale, chunk=1024):
    """dh, dB with fp64 logits from the same bf16 inputs (loss mean over valid rows)."""
    w64, a64 = w.double(), a.double()
    b64 = b.double().requires_grad_()
    n_valid = int((y != -100).sum())
    dh = torch.empty(h.shape, device=h.device, dtype=torch.float64)
    for s in range(0, h.shape[0], chunk):
        hc = h[s : s + chunk].double().requires_grad_()
        z = hc @ w64.t() + ((hc @ a64.t()) * scale) @ b64.t()
        loss = torch.nn.functional.cross_entropy(z, y[s : s + chunk], ignore_index=-100, reduction="sum") / n_valid
        loss.backward()
        dh[s : s + chunk] = hc.grad
    return dh, b64.grad


def bench(variant, backend, shape, ignore, reps, rate):
    n, hd, v, r = shape
    h0, w, a, b0, y = inputs(n, hd, v, r, ignore)
    scale = 2.0
    fn = make(variant, backend, scale)
    n_valid = int((y != -100).sum())
    row = {"variant": variant, "backend": backend, "shape": [n, hd, v, r], "ignored_frac": ignore,
           "matmul_tflops": rate, "floor_valid_ms": 6 * n_valid * hd * v / (rate * 1e12) * 1e3}

    def once():
        h = h0.clone().requires_grad_()
        b = b0.clone().requires_grad_()
        fn(h, w, a, b, y).backward()
        return h, b

    h, b = once()
    ref_dh, ref_db = reference(h0, w, a, b0, y, scale)
    row["err_dh"], row["err_db"] = rel(h.grad, ref_dh), rel(b.grad, ref_db)
    del h, b, ref_dh, ref_db
    row["ms"] = cuda_ms(once, reps)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    once()
    torch.cuda.synchronize()
    row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
    row["x_valid_floor"] = row["ms"] / row["floor_valid_ms"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_lora_head_kernel.json")
    ap.add_argument("--shapes", default="16384,4096,128256,16;8192,3584,152064,64")
    ap.add_argument("--ignored", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rate = matmul_tflops()
    meta = gpu_meta()  # card, date, versions on every row
    rows = []
    print(f"bf16 matmul {rate:.0f} TFLOP/s")
    print(f"{'shape':>26s} {'backend':12s} {'variant':13s} {'ms':>7s} {'x floor':>7s} {'peak MiB':>9s} {'err dh':>9s} {'err dB':>9s}")
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        for backend, variant in [("torch", "peft_unfused"), ("triton_fast", "whole"), ("triton_fast", "frozen_weight"),
                                 ("triton", "whole"), ("triton", "frozen_weight")]:
            row = bench(variant, backend, shape, args.ignored, args.reps, rate)
            rows.append(dict(row, **meta))
            print(f"{str(shape):>26s} {backend:12s} {variant:13s} {row['ms']:7.2f} {row['x_valid_floor']:7.3f} "
                  f"{row['peak_extra_mib']:9.0f} {row['err_dh']:9.2e} {row['err_db']:9.2e}", flush=True)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
