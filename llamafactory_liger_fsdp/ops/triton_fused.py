"""The logits GEMM with the loss in its epilogue (Hopper): ``z = h @ W^T`` tiles that never reach device memory as
fp32 unless asked. One persistent Triton kernel, three epilogues:

* ``stats``: per row and column tile the max, ``sum exp(z - max)``, the target logit and the sum of logits
  (softcapped when asked) -- the statistics pass without its read of ``z``, and without ``z`` written at all;
* ``stats`` with ``z_out``: the same and the fp32 ``z`` stored (the fast path keeps its dz pass);
* ``dz``: given the rows' final max and ``1 / sum``, dz rounded once to the inputs' 16-bit dtype, as
  :func:`.triton_kernels.dz_block` forms it for the dz pass (no fp32 ``z`` written or read).

Why (bench/RESULTS.md section 1): at small H the loss is bound by the bytes moved per logit outside the GEMMs (~18:
fp32 z written, read by the statistics, read by the dz pass, 16-bit dz written and read twice), as long as the GEMMs'
6H flops at H 896. The lean path, which computes the logits twice anyway, writes and reads no fp32 logits with it; the
fast path keeps cuBLAS (Triton 3.6's GEMM with the statistics epilogue runs at 470-660 TFLOP/s on H100 against
cuBLAS's 600-780, and recomputing the logits for dz costs more than the dz pass it saves): :func:`mode_for`. Forward
and backward run this same kernel and tile shape, so their logits are bitwise equal.

Used on CUDA compute capability 9 with 16-bit operands and 16-byte aligned rows (:func:`usable`); a compile failure
is logged once and the callers keep cuBLAS and the passes. ``FORCE`` (tests) runs it anywhere, the CPU interpreter
included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._log import info_rank0
from .triton_kernels import bf16_rne, dz_block, softcap_tanh

FORCE = False  # tests: run it wherever it can (the CPU interpreter too)
# BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M, warp-specialized (h200_triton_gemm_probe.json, commit 7a2f014)
CONFIG = (128, 256, 64, 3, 8, 8, True)
# Which paths use it, by hidden size: (fast-path mode, lean) for H <= each bound; above all bounds cuBLAS.
# "recompute": stats GEMM then dz GEMM (8 N_v H V flops, no fp32 logits); "stats": statistics in the epilogue of the
# stored-z GEMM. H100 (bench/RESULTS.md section 1, h100_kernel4_variants2.json): the lean path 4-16% faster with it at
# H 896-4096 (0/25/50% ignored), both fast-path modes slower (7-24%, 4-10%): lean only, up to the largest H measured.
RULES: list[tuple[int, str | None, bool]] = [(4096, None, True)]
STATS_ROWS = 4096  # rows of one statistics-only launch of the lean forward (its partials: 64 MiB at V 262144)
RECOMPUTE_ROWS_X = 2  # "recompute" keeps a 16-bit [c, V] dz, not fp32 logits: this many times the fast path's rows
_failed: list[str] = []


@triton.jit
def _round16(g, IS_BF16: tl.constexpr):
    """fp32 ``g`` rounded once to bf16 (:func:`.triton_kernels.bf16_rne`) or fp16."""
    if IS_BF16:  # (an if / else: one return, whose type the constexpr picks)
        out = bf16_rne(g)
    else:
        out = g.to(tl.float16)
    return out


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["y_ptr"])  # see triton_kernels
def _fused_kernel(
    a_desc, b_desc, z_desc, dz_desc, part_ptr, y_ptr, m_ptr, inv_s_ptr, M, N, K, n_tiles_n, softcap, off_target,
    out_scale, EPI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, IS_BF16: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, WS: tl.constexpr,
):
    """z = a @ b^T (a [M, K], b [N, K]) tile by tile, each program walking tiles NUM_SMS apart (grouped order).
    EPI 0: per (row, tile_n) part[0] max, part[1] sum exp(zc - max), part[2] zc at label ``y`` (0 if outside the
    tile), part[3] sum of zc (SMOOTH); zc the softcapped logits. EPI 1: that and z stored (fp32, two column halves).
    EPI 2: dz = (exp(zc - m) inv_s - off_target) [* (1 - th^2)] * out_scale rounded once into ``dz_desc``."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_tiles = n_m * n_tiles_n
    group = GROUP_M * n_tiles_n
    plane = M * n_tiles_n
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_SMS, flatten=True, warp_specialize=WS):
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
        if EPI == 2:
            m = tl.load(m_ptr + rm, mask=rmask, other=0.0)
            inv_s = tl.load(inv_s_ptr + rm, mask=rmask, other=0.0)
            g = dz_block(acc, m, inv_s, softcap, off_target, out_scale, HAS_SOFTCAP)
            dz_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], _round16(g, IS_BF16))
        else:
            if HAS_SOFTCAP:
                zc, _ = softcap_tanh(acc, softcap)
            else:
                zc = acc
            zm = tl.where(cmask, zc, float("-inf"))
            mt = tl.max(zm, axis=1)  # every tile holds at least one column: finite unless z is
            st = tl.sum(tl.exp(zm - mt[:, None]), axis=1)
            y = tl.load(y_ptr + rm, mask=rmask, other=-1)
            tt = tl.sum(tl.where(cmask & (rn[None, :] == y[:, None]), zc, 0.0), axis=1)
            off = rm.to(tl.int64) * n_tiles_n + pid_n
            tl.store(part_ptr + off, mt, mask=rmask)
            tl.store(part_ptr + plane + off, st, mask=rmask)
            tl.store(part_ptr + 2 * plane + off, tt, mask=rmask)
            if SMOOTH:
                tl.store(part_ptr + 3 * plane + off, tl.sum(tl.where(cmask, zc, 0.0), axis=1), mask=rmask)
            if EPI == 1:
                c0, c1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                z_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0)
                z_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c1)


def _aligned(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def usable(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernel runs for these operands: 16-bit, 16-byte aligned rows (``H % 8 == 0``), ``V % 8 ==
    0`` (the 16-bit dz rows), Hopper; anywhere under ``FORCE``; never after a compile failure."""
    if _failed or h.dtype not in (torch.bfloat16, torch.float16) or h.dtype != weight.dtype:
        return False
    if not (_aligned(h) and _aligned(weight)) or weight.shape[0] % 8:
        return False
    if FORCE:
        return True
    return h.is_cuda and torch.cuda.get_device_capability(h.device)[0] == 9


def mode_for(h: torch.Tensor, weight: torch.Tensor) -> tuple[str | None, bool]:
    """(fast-path mode: None, "stats" or "recompute"; whether the lean path uses it) for these operands, from
    ``RULES`` (the first rule whose bound is at least H)."""
    if not usable(h, weight):
        return None, False
    for bound, fast_mode, lean in RULES:
        if h.shape[1] <= bound:
            return fast_mode, lean
    return None, False


def _launch(h, weight, epi, *, z_out=None, dz_out=None, y=None, m=None, inv_s=None, softcap=None, eps=0.0,
            off_target=0.0, out_scale=1.0):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, group, ws = CONFIG
    rows, k = h.shape
    n = weight.shape[0]
    n_tiles_n = triton.cdiv(n, bn)
    part = None
    if epi != 2:
        part = torch.empty(4, rows, n_tiles_n, device=h.device, dtype=torch.float32)
        if not eps:
            part[3].zero_()  # unused, combined like the rest
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 4
    grid = (max(1, min(sms, triton.cdiv(rows, bm) * n_tiles_n)),)
    kw = {"num_stages": stages, "num_warps": warps} if h.is_cuda else {}
    a_desc = TensorDescriptor.from_tensor(h, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    z_desc = TensorDescriptor.from_tensor(z_out, [bm, bn // 2]) if z_out is not None else a_desc
    dz_desc = TensorDescriptor.from_tensor(dz_out, [bm, bn]) if dz_out is not None else a_desc
    dummy = part if part is not None else m
    try:
        _fused_kernel[grid](
            a_desc, b_desc, z_desc, dz_desc, dummy, y if y is not None else dummy, m if m is not None else dummy,
            inv_s if inv_s is not None else dummy, rows, n, k, n_tiles_n, float(softcap or 1.0), float(off_target),
            float(out_scale), EPI=epi, HAS_SOFTCAP=softcap is not None, SMOOTH=bool(eps),
            IS_BF16=h.dtype == torch.bfloat16, UPCAST=not h.is_cuda, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=group, NUM_SMS=grid[0], WS=ws and h.is_cuda, **kw,
        )
    except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as exc:
        _failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        info_rank0(f"[liger_fsdp] the fused logits kernel does not compile here ({_failed[0]}); the loss uses cuBLAS "
                   "and its passes instead (same results, slower at small hidden sizes).")
        return False, None
    return True, part


def combine(part, eps):
    """(max, sum exp(z - max), target logit, sum of logits or None) per row from per-(row, tile) ``part``."""
    m_max = part[0].max(dim=1, keepdim=True).values
    s = (part[1] * torch.exp(part[0] - m_max)).sum(dim=1)
    return m_max.squeeze(1), s, part[2].sum(dim=1), part[3].sum(dim=1) if eps else None


def logits_stats(h, weight, y, softcap, eps, z_out=None):
    """The rows' (max, sum exp, target logit, sum of logits) of ``h @ weight^T`` (and the fp32 logits into ``z_out``
    when given), or None where the kernel does not compile (the caller keeps cuBLAS and the pass)."""
    if z_out is not None and not _aligned(z_out):
        return None
    ok, part = _launch(h, weight, 1 if z_out is not None else 0, z_out=z_out, y=y, softcap=softcap, eps=eps)
    return combine(part, eps) if ok else None


def logits_dz(h, weight, dz_out, m, inv_s, softcap, eps, v, out_scale) -> bool:
    """``dz_out`` [rows, N] (16-bit) = dz of ``h @ weight^T`` for the rows' max ``m`` and ``inv_s`` (see
    :func:`.triton_kernels.launch_dz`; ``v`` the full vocabulary, for ``eps / v``); False where it does not compile."""
    if not _aligned(dz_out):
        return False
    return _launch(h, weight, 2, dz_out=dz_out, m=m.contiguous(), inv_s=inv_s.contiguous(), softcap=softcap,
                   off_target=eps / v, out_scale=out_scale)[0]
