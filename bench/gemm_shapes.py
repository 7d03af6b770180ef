"""cuBLAS rate of the fused loss's GEMM shapes on one GPU (bf16 operands, fp32 output, as ``ops.triton_flce`` calls
them): which tilings of the ``[N_v, V]`` logits keep the matmuls at the card's rate. Per shape and kind (``logits``
``h @ W_s^T``, ``dh`` ``dz @ W_s`` accumulated into fp32, ``dW`` ``dz^T @ h``): median ms of 10 and TFLOP/s. Rows to
JSON.

    python bench/gemm_shapes.py --out bench/results/h200_gemm_shapes.json
"""

from __future__ import annotations

import argparse
import json

import torch

from common import cuda_ms, gpu_meta

H = 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_gemm_shapes.json")
    args = ap.parse_args()
    rows, meta = [], gpu_meta()  # card, date, versions on every row
    for m in (2048, 3072, 4096, 11469):
        for n in (8192, 16384, 32768, 128256):
            h = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
            dz = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            z = torch.empty(m, n, device="cuda", dtype=torch.float32)
            dh = torch.zeros(m, H, device="cuda", dtype=torch.float32)
            dw = torch.zeros(n, H, device="cuda", dtype=torch.float32)
            kinds = {
                "logits": lambda: torch.mm(h, w.t(), out_dtype=torch.float32, out=z),
                "dh_accumulate": lambda: torch.addmm(dh, dz, w, out_dtype=torch.float32, out=dh),
                "dW_accumulate": lambda: torch.addmm(dw, dz.t(), h, out_dtype=torch.float32, out=dw),
                "dW_write": lambda: torch.mm(dz.t(), h, out_dtype=torch.float32, out=dw),
            }
            for kind, fn in kinds.items():
                ms = cuda_ms(fn, warmup=3)
                row = {"M": m, "N": n, "K": H, "kind": kind, "ms": ms, "tflops": 2 * m * n * H / (ms * 1e-3) / 1e12}
                rows.append(dict(row, **meta))
                print(f"{m:6d} x {n:6d}  {kind:14s} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s", flush=True)
            del h, w, dz, z, dh, dw
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
