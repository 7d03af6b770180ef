"""Triton fused linear cross-entropy: exact, memory-bounded, with the three matmuls on cuBLAS.

Design (counts for N rows, H hidden, V vocab; N_v = rows whose label is not ignored):

* **Ignored rows are skipped**, not masked: only the N_v valid rows are ever multiplied, so the
  flops are ``8 * N_v * H * V`` -- at 25% ignored labels that is exactly the ``6 N H V`` of the
  three unfused matmuls.
* **Forward** = ``2 N_v H V``: rows in chunks of ``c``; ``z = h_c @ W^T`` in fp32 (cuBLAS,
  bf16 operands, fp32 output), then :func:`_lse_kernel` reduces each row to its log-sum-exp in
  one read of ``z`` (split over column blocks, partial maxima/sums combined in fp32). Only
  ``lse [N_v]`` is kept for backward -- no ``[V, H]`` gradient is held from forward to backward
  (under FSDP the head weight is all-gathered again for backward anyway, and a ``dW`` kept from
  forward would sit through the whole decoder backward in an un-sharded buffer).
* **Backward** = ``6 N_v H V``: recompute ``z`` per tile (V-slab of ``v_s`` head rows x block of
  ``R`` valid rows), :func:`_dz_kernel` turns it into ``dz = (softmax - onehot) * scale`` (with
  the softcap chain rule) in the input dtype, then ``dh += dz @ W_s`` into an fp32
  ``[N_v, H]`` accumulator and ``dW_s (+)= dz^T @ h_r`` (straight into the bf16 output when one
  row block covers all rows, else through an fp32 ``[v_s, H]`` slab accumulator). Every
  accumulation over a long axis is fp32; ``dW`` and ``dh`` are rounded to the input dtype once.
* **Memory**: forward ``4 c V`` bytes; backward ``4 N_v H`` (dh accumulator) + ``6 R v_s``
  (fp32 logits + dz tile) + ``4 v_s H`` (slab accumulator, only when ``R < N_v``) + the gathered
  ``R x H`` rows. Tiles are sized from ``mem_budget``.
* **Deterministic**: no atomics; every reduction has a fixed order (cuBLAS GEMMs without
  split-K atomics are deterministic), so repeated runs give identical bits.

Logits are kept in fp32 from the GEMM on (the unfused model rounds them to bf16 first), so the
gradient error against an fp32 reference comes from the bf16 ``dz`` operand and the final
rounding only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DEFAULT_MEM_BUDGET = 224 * 1024 * 1024
FAST_CHUNK_BYTES = 1536 * 1024 * 1024  # fp32 logits + dz of one row chunk in the fast path


# --------------------------------------------------------------------------- kernels
@triton.jit
def _lse_kernel(
    z_ptr, stride_z, m_ptr, s_ptr, n_cols, cols_per_split, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Partial (max, sum exp) of one row over one column split of fp32 logits ``z``."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    start = split * cols_per_split
    stop = tl.minimum(start + cols_per_split, n_cols)
    base = z_ptr + row.to(tl.int64) * stride_z
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for off in range(start, stop, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < stop
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_SOFTCAP:
            t = z / softcap
            # tanh via exp; masked lanes stay -inf
            e = tl.exp(-2.0 * tl.abs(t))
            th = (1.0 - e) / (1.0 + e)
            th = tl.where(t < 0, -th, th)
            z = tl.where(mask, softcap * th, float("-inf"))
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
        s = s * tl.exp(m - m_safe) + tl.where(mask, tl.exp(z - m_safe), 0.0)
        m = m_new
    m_row = tl.max(m, axis=0)
    safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    s_row = tl.sum(s * tl.exp(m - safe), axis=0)
    tl.store(m_ptr + row * n_splits + split, m_row)
    tl.store(s_ptr + row * n_splits + split, s_row)


@triton.jit
def _dz_kernel(
    z_ptr, stride_z, dz_ptr, stride_dz, y_ptr, lse_ptr, scale_ptr, n_cols, col_offset, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    """dz = (softmax(zc) - onehot(y)) * scale [* (1 - (zc/cap)^2)] for one block of one row."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    z = tl.load(z_ptr + row.to(tl.int64) * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    y = tl.load(y_ptr + row)
    scale = tl.load(scale_ptr)
    if HAS_SOFTCAP:
        t = z / softcap
        e = tl.exp(-2.0 * tl.abs(t))
        th = (1.0 - e) / (1.0 + e)
        th = tl.where(t < 0, -th, th)
        zc = softcap * th
    else:
        zc = z
    p = tl.exp(zc - lse)
    g = p - tl.where(cols + col_offset == y, 1.0, 0.0)
    g = g * scale
    if HAS_SOFTCAP:
        g = g * (1.0 - th * th)
    tl.store(dz_ptr + row.to(tl.int64) * stride_dz + cols, g.to(dz_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- matmul helpers
def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output (fp32 accumulation inside; cuBLAS bf16 -> fp32 GEMM on CUDA)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


# --------------------------------------------------------------------------- planning
def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def plan_tiles(n_valid: int, h: int, v: int, need_h: bool, mem_budget: int) -> tuple[int, int, int]:
    """(forward row chunk c, backward vocab slab v_s, backward row block R) for a memory budget.

    Backward tiles never go below 2048 x 2048 (smaller GEMMs fall off the matmul roof and the
    per-tile launch overhead starts to show); when even that exceeds the budget -- the fp32 dh
    accumulator alone is ``4 N_v H`` -- the budget is exceeded rather than the speed.
    """
    c = max(16, min(n_valid, (mem_budget // (4 * v)) // 16 * 16)) if n_valid else 1
    acc = 4 * n_valid * h if need_h else 0
    left = mem_budget - acc

    def mem(v_s: int, r: int) -> int:
        return 6 * r * v_s + 2 * r * h + (4 * v_s * h if r < n_valid else 0)

    vmax = triton.next_power_of_2(v)
    # one row block first: it needs no slab accumulator (dW_s goes straight out of one GEMM)
    order = [(4096, n_valid), (2048, n_valid)] + [(v_s, r) for r in (8192, 4096, 2048) if r < n_valid for v_s in (4096, 2048)]
    for v_s, r in order:
        if mem(min(v_s, vmax), r) <= left:
            return c, min(v_s, vmax), max(r, 1)
    return c, min(2048, vmax), max(min(2048, n_valid), 1)


# --------------------------------------------------------------------------- autograd
def _lse(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    rows, n_cols = z.shape
    block = min(2048, triton.next_power_of_2(n_cols))
    splits = max(1, min(16, triton.cdiv(n_cols, 8192)))
    per_split = triton.cdiv(triton.cdiv(n_cols, splits), block) * block
    splits = triton.cdiv(n_cols, per_split)
    m = torch.empty(rows, splits, device=z.device, dtype=torch.float32)
    s = torch.empty(rows, splits, device=z.device, dtype=torch.float32)
    _lse_kernel[(rows, splits)](
        z, z.stride(0), m, s, n_cols, per_split, float(softcap or 1.0),
        HAS_SOFTCAP=softcap is not None, BLOCK=block, num_warps=8 if block >= 1024 else 4,
    )
    m_max = m.max(dim=1, keepdim=True).values
    return (m_max + torch.log((s * torch.exp(m - m_max)).sum(dim=1, keepdim=True))).squeeze(1)


def _capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


class _TritonFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, normalize, softcap, mem_budget):
        n, h = hidden.shape
        v = weight.shape[0]
        valid = labels != ignore_index
        idx = valid.nonzero().squeeze(1)
        n_valid = int(idx.numel())
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if isinstance(mem_budget, tuple):
            c, v_s, r = (max(1, min(t, n_valid or 1)) for t in mem_budget)
        else:
            c, v_s, r = plan_tiles(n_valid, h, v, need_h, mem_budget)
        lse = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        all_valid = n_valid == n
        y_valid = labels if all_valid else labels.index_select(0, idx)
        wt = weight.t()
        for s0 in range(0, n_valid, c):
            rows = slice(s0, s0 + c)
            h_c = hidden[rows] if all_valid else hidden.index_select(0, idx[rows])
            z = _mm_f32(h_c, wt)
            lse_c = _lse(z, softcap)
            tgt = _capped(z.gather(1, y_valid[rows].unsqueeze(1)).squeeze(1), softcap)
            lse[rows] = lse_c
            total += (lse_c - tgt).sum()
            del z
        denom = torch.tensor(float(max(n_valid, 1)) if normalize else 1.0, device=hidden.device)
        ctx.save_for_backward(hidden, weight, idx, y_valid, lse, denom)
        ctx.cfg = (softcap, v_s, r, all_valid)
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            return _TritonFLCE._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, idx, y_valid, lse, denom = ctx.saved_tensors
        softcap, v_s, r, all_valid = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, h = hidden.shape
        v = weight.shape[0]
        n_valid = int(idx.numel())
        dh = torch.zeros_like(hidden) if need_h else None
        dw = (torch.zeros_like(weight) if n_valid == 0 else torch.empty_like(weight)) if need_w else None
        if n_valid == 0 or not (need_h or need_w):
            return dh, dw, None, None, None, None, None
        scale = (grad_out.float() / denom).reshape(1).contiguous()
        dh_acc = torch.zeros(n_valid, h, device=hidden.device, dtype=torch.float32) if need_h else None
        one_block = r >= n_valid
        h_rows = None
        if one_block:
            h_rows = hidden if all_valid else hidden.index_select(0, idx)
        block = min(1024, triton.next_power_of_2(v_s))
        for s0 in range(0, v, v_s):
            w_s = weight[s0 : s0 + v_s]
            vs = w_s.shape[0]
            dw_acc = None
            if need_w and not one_block:
                dw_acc = torch.zeros(vs, h, device=weight.device, dtype=torch.float32)
            for r0 in range(0, n_valid, r):
                rows = slice(r0, r0 + r)
                if one_block:
                    h_r = h_rows
                else:
                    h_r = hidden[rows] if all_valid else hidden.index_select(0, idx[rows])
                z = _mm_f32(h_r, w_s.t())
                dz = torch.empty(z.shape, device=z.device, dtype=hidden.dtype)
                _dz_kernel[(z.shape[0], triton.cdiv(vs, block))](
                    z, z.stride(0), dz, dz.stride(0), y_valid[rows], lse[rows], scale, vs, s0,
                    float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, BLOCK=block, num_warps=4,
                )
                del z
                if need_h:
                    _addmm_f32_(dh_acc[rows], dz, w_s)
                if need_w:
                    if one_block:
                        torch.mm(dz.t(), h_r, out=dw[s0 : s0 + vs])
                    else:
                        _addmm_f32_(dw_acc, dz.t(), h_r)
                del dz
            if dw_acc is not None:
                dw[s0 : s0 + vs] = dw_acc
        if need_h:
            if all_valid:
                dh.copy_(dh_acc)
            else:
                dh.index_copy_(0, idx, dh_acc.to(hidden.dtype))
        return dh, dw, None, None, None, None, None


class _TritonFLCEFast(torch.autograd.Function):
    """Gradients computed in forward (``6 N_v H V``): per chunk of ``c`` valid rows, fp32 logits
    ``[c, V]`` -> lse -> ``dz`` -> ``dh_c = dz @ W`` (final) and ``dW += dz^T h_c`` into an fp32
    ``[V, H]`` accumulator. 25% fewer flops than the lean path, for ``4 V H`` (+ the ``[c, V]``
    chunk) of extra memory; backward only scales the saved gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, normalize, softcap, chunk_bytes):
        n, h = hidden.shape
        v = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        valid = labels != ignore_index
        idx = valid.nonzero().squeeze(1)
        n_valid = int(idx.numel())
        all_valid = n_valid == n
        y_valid = labels if all_valid else labels.index_select(0, idx)
        denom = float(max(n_valid, 1)) if normalize else 1.0
        scale = torch.full((1,), 1.0 / denom, device=hidden.device, dtype=torch.float32)
        dh = torch.zeros_like(hidden) if need_h else None
        dw_acc = torch.zeros(v, h, device=weight.device, dtype=torch.float32) if need_w else None
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        c = max(16, min(max(n_valid, 1), (chunk_bytes // (6 * v)) // 16 * 16))
        block = 1024
        wt = weight.t()
        for s0 in range(0, n_valid, c):
            rows = slice(s0, s0 + c)
            h_c = hidden[rows] if all_valid else hidden.index_select(0, idx[rows])
            z = _mm_f32(h_c, wt)
            lse_c = _lse(z, softcap)
            y_c = y_valid[rows]
            total += (lse_c - _capped(z.gather(1, y_c.unsqueeze(1)).squeeze(1), softcap)).sum()
            if need_h or need_w:
                dz = torch.empty(z.shape, device=z.device, dtype=hidden.dtype)
                _dz_kernel[(z.shape[0], triton.cdiv(v, block))](
                    z, z.stride(0), dz, dz.stride(0), y_c, lse_c, scale, v, 0, float(softcap or 1.0),
                    HAS_SOFTCAP=softcap is not None, BLOCK=block, num_warps=4,
                )
                del z
                if need_h:
                    dh_c = torch.mm(dz, weight)
                    if all_valid:
                        dh[rows] = dh_c
                    else:
                        dh.index_copy_(0, idx[rows], dh_c)
                if need_w:
                    _addmm_f32_(dw_acc, dz.t(), h_c)
                del dz
        dw = None
        if need_w:
            dw = dw_acc.to(weight.dtype)
            del dw_acc
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has = (need_h, need_w)
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        dh = saved.pop(0) if need_h else None
        dw = saved.pop(0) if need_w else None
        if not bool(grad_out == 1):
            dh = dh * grad_out.to(dh.dtype) if dh is not None else None
            dw = dw * grad_out.to(dw.dtype) if dw is not None else None
        return dh, dw, None, None, None, None, None


def fused_linear_cross_entropy_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    mem_budget: int = DEFAULT_MEM_BUDGET,
    tiles: tuple[int, int, int] | None = None,
    fast: bool = False,
) -> torch.Tensor:
    """Triton backend of :func:`llamafactory_liger_fsdp.ops.fused_linear_cross_entropy`.

    ``tiles=(c, v_s, R)`` overrides :func:`plan_tiles` (tests use it to reach every loop path)."""
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if fast:
            chunk_bytes = FAST_CHUNK_BYTES if tiles is None else 6 * weight.shape[0] * tiles[0]
            return _TritonFLCEFast.apply(
                hidden.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, reduction == "mean",
                softcap, chunk_bytes,
            )
        return _TritonFLCE.apply(
            hidden.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, reduction == "mean",
            softcap, mem_budget if tiles is None else tiles,
        )
