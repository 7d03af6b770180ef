"""The logits GEMM with the softmax statistics in its epilogue (issue 20): ``z = h @ W^T`` written in fp32 and, per
row and column tile, the max, ``sum exp(z - max)``, the target logit and the sum of logits (softcapped when asked),
so the fast path's statistics pass -- one more read of the ``[c, V]`` fp32 logits -- goes away.

One persistent Triton kernel: operands through TMA descriptors, 128 x 256 x 64 tiles, 3 stages, 8 warps, grouped
tile order, ``z`` stored through TMA in two column halves. On the H200 it is 0.5-0.6 ms slower than cuBLAS at
3072 x 4096 x 128256 but saves the 0.6-0.8 ms pass (``bench/results/h200_triton_gemm_probe.json``). The partial
statistics ``[4, rows, n_tiles]`` are combined by :func:`triton_flce._combine_parts`, the code the pass's column
splits use. ``z`` is the same fp32 GEMM result as cuBLAS's up to summation order (fp32 accumulation both).

Used where it was measured to pay: CUDA compute capability 9 (Hopper), 16-bit operands, row strides 16-byte aligned
(``H % 8 == 0``, ``V % 4 == 0``). Elsewhere, and if the kernel fails to compile (other Triton versions), the caller
keeps cuBLAS + the pass; the latter is logged once. ``FORCE`` (tests) runs it on any device, the CPU interpreter
included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._log import info_rank0

ENABLED = True  # bench/bench_flce.py's "project_fast_cublas" turns it off for the A/B rows
FORCE = False  # tests: run it wherever it can (the CPU interpreter too)
CONFIG = (128, 256, 64, 3, 8, 8)  # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M (bench/RESULTS.md section 1)
_failed: list[str] = []


@triton.jit
def _capped(z, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        t = z / softcap
        e = tl.exp(-2.0 * tl.abs(t))
        th = (1.0 - e) / (1.0 + e)
        z = softcap * tl.where(t < 0, -th, th)
    return z


@triton.jit
def _logits_stats_kernel(
    a_desc, b_desc, c_desc, part_ptr, y_ptr, M, N, K, n_tiles_n, softcap, HAS_SOFTCAP: tl.constexpr,
    SMOOTH: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
):
    """z = a @ b^T (a [M, K], b [N, K]) into ``c_desc`` in fp32; per (row, tile_n): part[0] max, part[1]
    sum exp(zc - max), part[2] zc at the row's label ``y`` (0 if outside the tile), part[3] sum of zc (SMOOTH), with
    zc the softcapped logits. Every program walks tiles NUM_SMS apart."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_tiles = n_m * n_tiles_n
    group = GROUP_M * n_tiles_n
    plane = M * n_tiles_n
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_SMS, flatten=True):
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            a_t = a_desc.load([pid_m * BLOCK_M, k])
            b_t = b_desc.load([pid_n * BLOCK_N, k])
            if UPCAST:  # the CPU interpreter's dot reads 16-bit floats as their integer bits
                a_t, b_t = a_t.to(tl.float32), b_t.to(tl.float32)
            acc = tl.dot(a_t, b_t.T, acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rm < M
        cmask = (rn < N)[None, :]
        zc = _capped(acc, softcap, HAS_SOFTCAP)
        zm = tl.where(cmask, zc, float("-inf"))
        m = tl.max(zm, axis=1)  # every tile holds at least one column: finite unless z is
        s = tl.sum(tl.exp(zm - m[:, None]), axis=1)
        y = tl.load(y_ptr + rm, mask=rmask, other=-1)
        t = tl.sum(tl.where(cmask & (rn[None, :] == y[:, None]), zc, 0.0), axis=1)
        off = rm.to(tl.int64) * n_tiles_n + pid_n
        tl.store(part_ptr + off, m, mask=rmask)
        tl.store(part_ptr + plane + off, s, mask=rmask)
        tl.store(part_ptr + 2 * plane + off, t, mask=rmask)
        if SMOOTH:
            tl.store(part_ptr + 3 * plane + off, tl.sum(tl.where(cmask, zc, 0.0), axis=1), mask=rmask)
        c0, c1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c1)


def _aligned(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def usable(h: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether :func:`logits_and_parts` runs for these operands (see the module docstring)."""
    if _failed or not (ENABLED or FORCE) or h.dtype not in (torch.bfloat16, torch.float16) or h.dtype != weight.dtype:
        return False
    if not (_aligned(h) and _aligned(weight) and _aligned(z)):
        return False
    if FORCE:
        return True
    return h.is_cuda and torch.cuda.get_device_capability(h.device)[0] == 9


def logits_and_parts(h: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, y: torch.Tensor, softcap, eps):
    """Fill ``z`` [c, V] with ``h @ weight^T`` (fp32) and return the partial statistics ``[4, c, n_tiles]``, or None
    when the kernel does not compile here (logged once; the caller uses cuBLAS + the pass)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, group = CONFIG
    rows, k = h.shape
    n = weight.shape[0]
    n_tiles_n = triton.cdiv(n, bn)
    part = torch.empty(4, rows, n_tiles_n, device=h.device, dtype=torch.float32)
    if not eps:
        part[3].zero_()  # unused, combined like the rest
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 4
    grid = (max(1, min(sms, triton.cdiv(rows, bm) * n_tiles_n)),)
    kw = {"num_stages": stages, "num_warps": warps} if h.is_cuda else {}
    try:
        _logits_stats_kernel[grid](
            TensorDescriptor.from_tensor(h, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(z, [bm, bn // 2]), part, y, rows, n, k, n_tiles_n, float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, SMOOTH=bool(eps), UPCAST=not h.is_cuda, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, GROUP_M=group, NUM_SMS=grid[0], **kw,
        )
    except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as exc:
        _failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        info_rank0(f"[liger_fsdp] the fused logits+statistics kernel does not compile here ({_failed[0]}); the fast "
                   "path uses cuBLAS and a statistics pass instead (same results, a few % slower).")
        return None
    return part
