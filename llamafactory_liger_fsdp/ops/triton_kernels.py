"""The Triton kernels of the fused loss and their launchers: per-row softmax statistics of fp32 logits, dz (into its
own buffer or written over the logits), the target term's row sums, and the final scale-and-round of a gradient.

bf16 is rounded to nearest even by hand (:func:`bf16_rne`): the GPU's cast gives the same bits, the interpreter's
truncates. No atomics; fixed reduction orders. Row counts (and pointers into a slice of rows) are not specialized
(``do_not_specialize``): a new number of labelled rows must not compile a kernel again in the middle of training.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Each program handles BLOCK_R rows: 1 on the GPU; several under the CPU interpreter, whose cost
# is per program (the same code, a wider tile).
def block_r(t: torch.Tensor) -> int:
    return 1 if t.is_cuda else 16


@triton.jit
def softcap_tanh(z, softcap):
    """(softcap * tanh(z / softcap), the tanh): the capped logits and the factor their gradient needs."""
    t = z / softcap
    e = tl.exp(-2.0 * tl.abs(t))
    th = (1.0 - e) / (1.0 + e)
    th = tl.where(t < 0, -th, th)
    return softcap * th, th


@triton.jit(do_not_specialize=["n_rows"],
            do_not_specialize_on_alignment=["m_ptr", "s_ptr", "t_ptr", "zs_ptr"])
def stats_kernel(
    z_ptr, stride_z, y_ptr, m_ptr, s_ptr, t_ptr, zs_ptr, stride_p, n_rows, n_cols, cols_per_split, col_offset,
    softcap, HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per row of fp32 logits ``z`` over one column split: max, sum exp(z - max), the target
    logit (if the label falls in these columns) and the sum of logits (if SMOOTH). ACCUMULATE
    (one split) folds them into running values at ``[row]``; else they go to ``[row, split]``.

    One exp per logit: each lane keeps its running max ``m`` and sum ``s``; with ``e = exp(-|z - m|)`` a new max
    gives ``s e + 1`` and any other value ``s + e`` -- bitwise the textbook ``s exp(m - m') + exp(z - m')``, whose
    second exp is ``exp(0)`` or whose first is ``exp(0)``. The target logit is one load per row after the loop."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    split = tl.program_id(1)
    start = split * cols_per_split
    stop = tl.minimum(start + cols_per_split, n_cols)
    base = z_ptr + rows.to(tl.int64)[:, None] * stride_z
    y = tl.load(y_ptr + rows, mask=rmask, other=-1) - col_offset
    m = tl.full((BLOCK_R, BLOCK), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R, BLOCK), tl.float32)
    zs = tl.zeros((BLOCK_R, BLOCK), tl.float32)
    for off in range(start, stop, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < stop)[None, :]
        z = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z, _ = softcap_tanh(z, softcap)
        if SMOOTH:
            zs += tl.where(mask, z, 0.0)
        zm = tl.where(mask, z, float("-inf"))
        e = tl.exp(-tl.abs(zm - m))  # NaN only where both are -inf: a masked lane before any value, kept as is
        s = tl.where(zm > m, s * e + 1.0, tl.where(mask, s + e, s))
        m = tl.maximum(m, zm)
    m_row = tl.max(m, axis=1)
    safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    s_row = tl.sum(s * tl.exp(m - safe[:, None]), axis=1)
    hit = rmask & (y >= start) & (y < stop)
    zy = tl.load(base + tl.where(hit, y, 0)[:, None], mask=hit[:, None], other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        zy, _ = softcap_tanh(zy, softcap)
    t_row = tl.sum(tl.where(hit[:, None], zy, 0.0), axis=1)
    zs_row = tl.sum(zs, axis=1)
    if ACCUMULATE:
        m_old = tl.load(m_ptr + rows, mask=rmask, other=0.0)
        s_old = tl.load(s_ptr + rows, mask=rmask, other=0.0)
        m_n = tl.maximum(m_old, m_row)
        safe_n = tl.where(m_n == float("-inf"), 0.0, m_n)
        tl.store(s_ptr + rows, s_old * tl.exp(m_old - safe_n) + s_row * tl.exp(m_row - safe_n), mask=rmask)
        tl.store(m_ptr + rows, m_n, mask=rmask)
        tl.store(t_ptr + rows, tl.load(t_ptr + rows, mask=rmask, other=0.0) + t_row, mask=rmask)
        if SMOOTH:
            tl.store(zs_ptr + rows, tl.load(zs_ptr + rows, mask=rmask, other=0.0) + zs_row, mask=rmask)
    else:
        o = rows * stride_p + split
        tl.store(m_ptr + o, m_row, mask=rmask)
        tl.store(s_ptr + o, s_row, mask=rmask)
        tl.store(t_ptr + o, t_row, mask=rmask)
        if SMOOTH:
            tl.store(zs_ptr + o, zs_row, mask=rmask)


@triton.jit
def dz_block(z, m, inv_s, softcap, off_target, out_scale, HAS_SOFTCAP: tl.constexpr):
    """The fp32 dz block from fp32 logits ``z`` and the rows' max ``m`` and ``1 / sum`` (see :func:`_dz_kernel`),
    before rounding: one formula for the dz passes and the fused GEMM's dz epilogue (``triton_fused``), so their dz
    stays bitwise equal; each caller rounds and stores it its own way."""
    if HAS_SOFTCAP:
        zc, th = softcap_tanh(z, softcap)
    else:
        zc = z
    g = tl.exp(zc - m[:, None]) * inv_s[:, None] - off_target
    if HAS_SOFTCAP:
        g = g * (1.0 - th * th)
    return g * out_scale


@triton.jit
def bf16_rne(g):
    """fp32 ``g`` rounded to bf16, to nearest even, by hand: the GPU's cast gives the same bits, the interpreter's
    truncates (the one copy of this trick: the passes here and the fused GEMM's epilogue, ``triton_fused``)."""
    bits = g.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_to(g, dst_ptr, IS_BF16: tl.constexpr):
    """fp32 ``g`` rounded once to the dtype of ``dst_ptr`` (bf16: :func:`bf16_rne`)."""
    if IS_BF16:
        return bf16_rne(g)
    return g.to(dst_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["n_rows"])
def _dz_kernel(
    z_ptr, stride_z, dz_ptr, stride_dz, m_ptr, inv_s_ptr, n_rows, n_cols, softcap, off_target, out_scale,
    HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):
    """dz = (softmax(zc) - off_target) [* (1 - (zc/cap)^2)] * out_scale, rounded once to dz's
    dtype; softmax = exp(zc - max) / sum, as torch computes it (``exp(zc - lse)`` would carry the
    rounding of a large ``lse`` into every probability). out_scale is a power of two.
    The target's ``-(1 - eps)`` is *not* in dz (``p_y - 1``
    would lose ``p_y`` to the rounding): :func:`_rows_axpy_kernel` adds it in fp32. bf16 is rounded
    to nearest even by hand: the GPU's cast gives the same bits, the interpreter's truncates."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    z = tl.load(z_ptr + r64 * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + rows, mask=rmask, other=0.0)
    inv_s = tl.load(inv_s_ptr + rows, mask=rmask, other=0.0)
    out = _round_to(dz_block(z, m, inv_s, softcap, off_target, out_scale, HAS_SOFTCAP), dz_ptr, IS_BF16)
    tl.store(dz_ptr + r64 * stride_dz + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _dz_inplace_kernel(
    z_ptr, stride_z, dz_ptr, stride_dz, m_ptr, inv_s_ptr, n_rows, n_cols, softcap, off_target, out_scale,
    HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):
    """:func:`_dz_kernel` with ``dz`` written over ``z`` (the same storage; a 16-bit dz row occupies the first half
    of its fp32 z row): one program walks whole rows, column block by column block; a block's 16-bit results land on
    z entries of that block or earlier ones, already loaded, and the barrier keeps every load of a block before any
    store of it."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    r64 = rows.to(tl.int64)[:, None]
    m = tl.load(m_ptr + rows, mask=rmask, other=0.0)
    inv_s = tl.load(inv_s_ptr + rows, mask=rmask, other=0.0)
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        z = tl.load(z_ptr + r64 * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        out = _round_to(dz_block(z, m, inv_s, softcap, off_target, out_scale, HAS_SOFTCAP), dz_ptr, IS_BF16)
        tl.debug_barrier()
        tl.store(dz_ptr + r64 * stride_dz + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["n_dst"],
            do_not_specialize_on_alignment=["starts_ptr"])
def _rows_axpy_kernel(
    dst_ptr, stride_dst, dst_rows_ptr, src_ptr, stride_src, src_rows_ptr, coef_ptr, starts_ptr, n_dst, n_cols,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):
    """dst[dst_rows[p]] += sum over k in [starts[p], starts[p+1]) of coef[k] * src[src_rows[k]],
    fp32, k in order; ``dst_rows`` distinct, each written by one program (no atomics)."""
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pmask = p < n_dst
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < n_cols
    k0 = tl.load(starts_ptr + p, mask=pmask, other=0)
    lens = tl.load(starts_ptr + p + 1, mask=pmask, other=0) - k0
    acc = tl.zeros((BLOCK_R, BLOCK), tl.float32)
    for j in range(tl.max(lens, axis=0)):
        active = pmask & (j < lens)
        r = tl.load(src_rows_ptr + k0 + j, mask=active, other=0).to(tl.int64)
        c = tl.load(coef_ptr + k0 + j, mask=active, other=0.0)
        x = tl.load(src_ptr + r[:, None] * stride_src + cols[None, :], mask=active[:, None] & cmask[None, :], other=0.0)
        acc += c[:, None] * x.to(tl.float32)
    d = tl.load(dst_rows_ptr + p, mask=pmask, other=0).to(tl.int64)
    ptr = dst_ptr + d[:, None] * stride_dst + cols[None, :]
    mask = pmask[:, None] & cmask[None, :]
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + acc, mask=mask)


def rows_axpy(dst, dst_rows, src, src_rows, coef, starts):
    """See :func:`_rows_axpy_kernel`; ``dst`` fp32, ``len(dst_rows) + 1 == len(starts)``."""
    n_dst = dst_rows.numel()
    if n_dst == 0:
        return
    br = block_r(dst)
    block = min(1024, triton.next_power_of_2(dst.shape[1]))
    _rows_axpy_kernel[(triton.cdiv(n_dst, br), triton.cdiv(dst.shape[1], block))](
        dst, dst.stride(0), dst_rows, src, src.stride(0), src_rows, coef, starts, n_dst, dst.shape[1],
        BLOCK_R=br, BLOCK=block, num_warps=4,
    )


@triton.jit(do_not_specialize=["n_rows"])
def _scale_cast_kernel(
    src_ptr, stride_src, dst_ptr, stride_dst, dst_rows_ptr, scale_ptr, n_rows, n_cols,
    ROW_SCALE: tl.constexpr, SCATTER: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):
    """dst[d_i] = round(src[i] * scale[.]) with ``d_i = dst_rows[i]`` (``SCATTER``) or ``i``; scale one fp32 value in
    device memory or one per row (``ROW_SCALE``). One read of fp32, one write of the output dtype (the same bits as
    ``torch.mul(src, scale, out=dst)``)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(src_ptr + r64[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:
        g = x * tl.load(scale_ptr + rows, mask=rmask, other=0.0)[:, None]
    else:
        g = x * tl.load(scale_ptr)
    d = tl.load(dst_rows_ptr + rows, mask=rmask, other=0).to(tl.int64) if SCATTER else r64
    tl.store(dst_ptr + d[:, None] * stride_dst + cols[None, :], _round_to(g, dst_ptr, IS_BF16), mask=mask)


def scale_cast(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, dst_rows: torch.Tensor | None = None):
    """``out[dst_rows or :] = src * scale`` rounded once (``src`` fp32 [R, C], ``scale`` a 0-d or [R] tensor): one pass,
    where ``torch.mul`` into a 16-bit ``out`` takes its slow mixed-dtype path and a scatter would need a copy."""
    n_rows, n_cols = src.shape
    if n_rows == 0 or n_cols == 0:
        return out
    scale = scale.to(device=src.device, dtype=torch.float32).contiguous()
    rows = dst_rows if dst_rows is not None else scale  # (an unused pointer when not scattering)
    br, block = (8, 512) if src.is_cuda else (16, min(1024, triton.next_power_of_2(n_cols)))
    _scale_cast_kernel[(triton.cdiv(n_rows, br), triton.cdiv(n_cols, block))](
        src, src.stride(0), out, out.stride(0), rows, scale, n_rows, n_cols, ROW_SCALE=scale.dim() > 0,
        SCATTER=dst_rows is not None, IS_BF16=out.dtype == torch.bfloat16, BLOCK_R=br, BLOCK=block, num_warps=4,
    )
    return out


def chunk_stats(z, y_c, softcap, eps):
    """(max, sum exp(z - max), target logit, sum of logits) of fp32 logits ``z`` [c, V] (all of V),
    split over columns."""
    rows, n_cols = z.shape
    block = min(2048, triton.next_power_of_2(n_cols))
    splits = max(1, min(16, triton.cdiv(n_cols, 8192)))
    per_split = triton.cdiv(triton.cdiv(n_cols, splits), block) * block
    splits = triton.cdiv(n_cols, per_split)
    part = torch.empty(4, rows, splits, device=z.device, dtype=torch.float32)
    br = block_r(z)
    stats_kernel[(triton.cdiv(rows, br), splits)](
        z, z.stride(0), y_c, part[0], part[1], part[2], part[3], splits, rows, n_cols, per_split, 0,
        float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, SMOOTH=bool(eps), ACCUMULATE=False, BLOCK_R=br,
        BLOCK=block, num_warps=8 if block >= 1024 else 4,
    )
    m_max = part[0].max(dim=1, keepdim=True).values
    s = (part[1] * torch.exp(part[0] - m_max)).sum(dim=1)
    return m_max.squeeze(1), s, part[2].sum(dim=1), part[3].sum(dim=1) if eps else None


def launch_dz(z, dz, m, inv_s, softcap, eps, v, out_scale):
    block = min(1024, triton.next_power_of_2(z.shape[1]))
    br = block_r(z)
    _dz_kernel[(triton.cdiv(z.shape[0], br), triton.cdiv(z.shape[1], block))](
        z, z.stride(0), dz, dz.stride(0), m, inv_s, z.shape[0], z.shape[1], float(softcap or 1.0), eps / v, out_scale,
        HAS_SOFTCAP=softcap is not None, IS_BF16=dz.dtype == torch.bfloat16, BLOCK_R=br, BLOCK=block, num_warps=4,
    )


def dz_over(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dz view written over the fp32 logits ``z`` [c, V]: the first V 16-bit values of each row (row stride 2V),
    or ``z`` itself in fp32."""
    return z if dtype == torch.float32 else z.view(dtype)[:, : z.shape[1]]


def launch_dz_inplace(z, dz, m, inv_s, softcap, eps, v, out_scale):
    block = min(1024, triton.next_power_of_2(z.shape[1]))
    br = block_r(z)
    _dz_inplace_kernel[(triton.cdiv(z.shape[0], br),)](
        z, z.stride(0), dz, dz.stride(0), m, inv_s, z.shape[0], z.shape[1], float(softcap or 1.0), eps / v, out_scale,
        HAS_SOFTCAP=softcap is not None, IS_BF16=dz.dtype == torch.bfloat16, BLOCK_R=br, BLOCK=block, num_warps=8,
    )
