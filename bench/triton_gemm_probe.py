"""Issue 20's open question, as one device call: can a Triton GEMM carry the softmax statistics in its epilogue at
cuBLAS's rate on the fused loss's logits shapes?

For ``z = h @ W^T`` (bf16 operands, fp32 output ``[M, N]``, K = H) three ways: cuBLAS (``torch.mm(out_dtype=fp32)``,
what ``ops.triton_flce`` calls), a Triton tiled GEMM writing ``z``, and the same GEMM also writing each tile's
per-row ``max`` and ``sum exp(z - max)`` (``[2, M, N / BLOCK_N]``, what a fused kernel would combine into the
log-sum-exp instead of a second pass over ``z``). Reports ms and TFLOP/s per shape and config (autotuned over a few
Hopper-sized tiles), and checks ``z`` against cuBLAS and the combined lse against ``torch.logsumexp``. Rows to JSON.
A fused kernel pays only if the "stats" row stays within ~5% of cuBLAS (the stats pass it removes is ~5% of the call).
``--tma-sweep``: the persistent TMA kernel over more configs (TMA store, warp specialization, stages, GROUP_M).

Answer on the H200 (``bench/results/h200_triton_gemm_probe.json``, Triton 3.6): the best Triton GEMM runs 6-10% below
cuBLAS (pointer kernels 25-30%), so GEMM + epilogue statistics beats cuBLAS + the pass by only 2-8% on the logits step;
wired into the fast path (commit 7a2f014) it made the whole call 0.2% (median) / 1.2% (min) faster over the 18 rows of
``h200_kernel3_fused_ab.json`` and was removed again (bench/RESULTS.md section 1).

    python bench/triton_gemm_probe.py --out bench/results/h200_triton_gemm_probe.json
    TRITON_INTERPRET=1 python bench/triton_gemm_probe.py --cpu-check     # correctness on small shapes, no GPU
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from common import cuda_ms, gpu_meta

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 256, 64, 4, 8), (128, 128, 128, 3, 8),
]


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, st_ptr, M, N, K, n_tiles_n, stride_am, stride_bn, stride_cm,
               STATS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    """c = a @ b^T in fp32 (a [M, K], b [N, K], both K-contiguous); with STATS each tile also writes its rows' max and
    sum exp(c - max) over its valid columns to st[0 / 1, row, tile_n]."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    group = GROUP_M * n_tiles_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        a_t = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b_t = tl.load(b, mask=(rn[None, :] < N) & (rk[:, None] + k < K), other=0.0)
        if UPCAST:  # the CPU interpreter's dot reads bf16 as its integer bits
            a_t, b_t = a_t.to(tl.float32), b_t.to(tl.float32)
        acc = tl.dot(a_t, b_t, acc)
        a += BLOCK_K
        b += BLOCK_K
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc, mask=mask)
    if STATS:
        _tile_stats(acc, st_ptr, rm, rn, M, N, n_tiles_n, pid_n)


@triton.jit
def _tile_stats(acc, st_ptr, rm, rn, M, N, n_tiles_n, pid_n):
    z = tl.where(rn[None, :] < N, acc, float("-inf"))
    m = tl.max(z, axis=1)
    s = tl.sum(tl.exp(z - m[:, None]), axis=1)
    off = rm.to(tl.int64) * n_tiles_n + pid_n
    tl.store(st_ptr + off, m, mask=rm < M)
    tl.store(st_ptr + M * n_tiles_n + off, s, mask=rm < M)


@triton.jit
def _tma_kernel(a_desc, b_desc, c_desc, c_ptr, st_ptr, M, N, K, n_tiles_n, stride_cm, STATS: tl.constexpr,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, TMA_STORE: tl.constexpr, WS: tl.constexpr):
    """Persistent c = a @ b^T: operands through TMA descriptors, each program walks tiles NUM_SMS apart (grouped
    order), c stored from registers (or, TMA_STORE, in two column halves through ``c_desc``); WS: warp-specialized
    loop; STATS as in _mm_kernel."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_tiles = n_m * n_tiles_n
    group = GROUP_M * n_tiles_n
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            a_t = a_desc.load([pid_m * BLOCK_M, k])
            b_t = b_desc.load([pid_n * BLOCK_N, k])
            if UPCAST:
                a_t, b_t = a_t.to(tl.float32), b_t.to(tl.float32)
            acc = tl.dot(a_t, b_t.T, acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if STATS:
            _tile_stats(acc, st_ptr, rm, rn, M, N, n_tiles_n, pid_n)
        if TMA_STORE:
            c0, c1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c1)
        else:
            tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc,
                     mask=(rm[:, None] < M) & (rn[None, :] < N))


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M, TMA store, warp-specialized): the second call's sweep
TMA_SWEEP = [
    (256, 128, 64, 3, 8, 8, 0, 0), (256, 128, 64, 4, 8, 8, 0, 0), (256, 128, 64, 3, 8, 16, 0, 0),
    (256, 128, 64, 3, 8, 4, 0, 0), (256, 128, 64, 2, 8, 8, 0, 0), (256, 128, 64, 3, 8, 8, 1, 0),
    (256, 128, 64, 4, 8, 8, 1, 0), (128, 256, 64, 3, 8, 8, 1, 0), (128, 256, 64, 4, 8, 8, 1, 0),
    (128, 128, 64, 5, 4, 8, 1, 0), (256, 128, 64, 3, 8, 8, 0, 1), (256, 128, 64, 3, 8, 8, 1, 1),
    (128, 256, 64, 3, 8, 8, 1, 1),
]


def tma_mm(a, b, cfg, stats: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, group, tma_store, ws = (tuple(cfg) + (8, 0, 0))[:8]
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    n_tiles_n = triton.cdiv(n, bn)
    st = torch.empty(2, m, n_tiles_n, device=a.device, dtype=torch.float32) if stats else c
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn // 2]) if tma_store else None
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    grid = (min(sms, triton.cdiv(m, bm) * n_tiles_n),)
    kw = {} if not a.is_cuda else {"num_stages": stages, "num_warps": warps}
    _tma_kernel[grid](TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]), c_desc, c,
                      st, m, n, k, n_tiles_n, c.stride(0), STATS=stats, UPCAST=not a.is_cuda, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, GROUP_M=group, NUM_SMS=grid[0], TMA_STORE=bool(tma_store), WS=bool(ws), **kw)
    return c, (st if stats else None)


def triton_mm(a, b, cfg, stats: bool):
    bm, bn, bk, stages, warps = cfg
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    n_tiles_n = triton.cdiv(n, bn)
    st = torch.empty(2, m, n_tiles_n, device=a.device, dtype=torch.float32) if stats else c
    grid = (triton.cdiv(m, bm) * n_tiles_n,)
    kw = {} if not a.is_cuda else {"num_stages": stages, "num_warps": warps}
    _mm_kernel[grid](a, b, c, st, m, n, k, n_tiles_n, a.stride(0), b.stride(0), c.stride(0), STATS=stats,
                     UPCAST=not a.is_cuda, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, **kw)
    return c, (st if stats else None)


def lse_from_stats(st):
    m = st[0].max(dim=1, keepdim=True).values
    return (m.squeeze(1) + torch.log((st[1] * torch.exp(st[0] - m)).sum(dim=1)))


def check(a, b, cfg, mm=None):
    c, st = (mm or triton_mm)(a, b, cfg, stats=True)
    ref = a.float() @ b.float().t()
    err_c = float((c - ref).norm() / ref.norm())
    err_lse = float((lse_from_stats(st) - torch.logsumexp(ref, dim=1)).abs().max())
    return err_c, err_lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_triton_gemm_probe.json")
    ap.add_argument("--shapes", default="3072,4096,128256;11469,4096,8192;4096,8192,128256")
    ap.add_argument("--cpu-check", action="store_true", help="small shapes under TRITON_INTERPRET=1")
    ap.add_argument("--tma-sweep", action="store_true", help="only cuBLAS (+ stats pass) and TMA_SWEEP with stats")
    args = ap.parse_args()
    if args.cpu_check:
        g = torch.Generator().manual_seed(0)
        for m, k, n in ((37, 48, 200), (64, 32, 129)):
            a = torch.randn(m, k, generator=g).bfloat16()
            b = torch.randn(n, k, generator=g).bfloat16()
            for name, mm, cfg in (("pointers", triton_mm, (16, 32, 16, 1, 1)), ("tma", tma_mm, (16, 32, 16, 1, 1)),
                                  ("tma store", tma_mm, (16, 32, 16, 1, 1, 2, 1, 0))):
                if name == "tma store" and n % 4:  # a TMA store needs 16-byte row strides
                    continue
                err_c, err_lse = check(a, b, cfg, mm)
                print(f"{name} {m}x{k}x{n}: rel err z {err_c:.1e}, max |lse err| {err_lse:.1e}")
                assert err_c < 1e-5 and err_lse < 1e-4
        return
    rows, meta = [], gpu_meta()  # card, date, versions on every row
    for spec in args.shapes.split(";"):
        m, k, n = map(int, spec.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        b = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        flop = 2 * m * n * k
        out = torch.empty(m, n, device="cuda", dtype=torch.float32)
        ms = cuda_ms(lambda: torch.mm(a, b.t(), out_dtype=torch.float32, out=out), warmup=3)
        rows.append({"shape": [m, k, n], "impl": "cublas", "ms": ms, "tflops": flop / ms / 1e9, **meta})
        print(json.dumps(rows[-1]), flush=True)
        # what a fused epilogue replaces: cuBLAS then the loss's own statistics pass over z
        from llamafactory_liger_fsdp.ops.triton_kernels import chunk_stats as _chunk_stats

        y = torch.randint(0, n, (m,), device="cuda")
        ms2 = cuda_ms(lambda: (torch.mm(a, b.t(), out_dtype=torch.float32, out=out), _chunk_stats(out, y, None, 0.0)),
                      warmup=3)
        rows.append({"shape": [m, k, n], "impl": "cublas+stats_pass", "ms": ms2, "tflops": flop / ms2 / 1e9, **meta})
        print(json.dumps(rows[-1]), flush=True)
        del out
        plan = [(c, km) for c in CONFIGS for km in (("triton", triton_mm), ("tma", tma_mm))]
        if args.tma_sweep:
            plan = [(c, ("tma", tma_mm)) for c in TMA_SWEEP]
        for cfg, (kind, mm) in plan:
            for stats in ((True,) if args.tma_sweep else (False, True)):
                row = {"shape": [m, k, n], "impl": kind + ("_stats" if stats else ""), "config": list(cfg), **meta}
                try:
                    row["ms"] = cuda_ms(lambda: mm(a, b, cfg, stats), warmup=3)
                    row["tflops"] = flop / row["ms"] / 1e9
                    if stats:
                        row["err_z"], row["err_lse"] = check(a[:1024], b, cfg, mm)
                except Exception as exc:  # a config the compiler refuses (shared memory) is reported, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
