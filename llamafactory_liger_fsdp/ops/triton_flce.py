"""Triton fused linear cross-entropy, with the matmuls on cuBLAS.

Counts for N rows, H hidden, V vocab; N_v = rows whose label is not ignored (only those are
ever multiplied: at 25% ignored labels the ``8 N_v H V`` flops of the lean path equal the
``6 N H V`` of the three unfused matmuls).

* **Lean** (``triton``): forward and backward walk the same tiles -- ``R`` valid rows x a
  vocabulary slab of ``v_s`` head rows. Forward: ``z = h_r @ W_s^T`` in fp32 (bf16 operands,
  fp32 output), :func:`_stats_kernel` folds each tile into running per-row (max, sum exp,
  target logit, sum of logits); only those ``[N_v]`` vectors are kept. Backward recomputes each
  tile with the *same* GEMM (same shapes and operands, so bitwise the same logits as forward),
  :func:`_dz_kernel` writes ``dz = softmax - eps/V`` in the input dtype, ``dh_acc += dz @ W_s``
  and ``dW_s += dz^T @ h_r`` in fp32, and :class:`_Targets` adds the target term. Memory: ``4 N_v H``
  (dh accumulator) + ``6 R v_s`` (fp32 logits + bf16 dz) + ``4 v_s H`` (dW slab) + gathered rows;
  tiles are chosen from ``mem_budget`` by :func:`plan_tiles`.
* **Fast** (``triton_fast``): gradients computed in forward for chunks of ``c`` rows x all of
  V (``6 N_v H V``); ``dh`` [N_v, H] and ``dW`` [V, H] kept in fp32 until backward multiplies
  them by ``grad_output`` and rounds once. One ``[c, V]`` fp32 buffer per call: the chunk's logits,
  then its 16-bit dz written over them (:func:`_dz_inplace_kernel`). ``reduction="none"`` with gradients (per-row
  ``grad_output``, unknown in forward) keeps dz itself where it fits (:mod:`.triton_rows`), else uses the lean path.

Exactness: ``dz`` is rounded to the input dtype *unscaled* and without the target's
``-(1 - eps)`` (``p_y - 1`` would lose ``p_y`` to the rounding; that term is added in fp32 after
the GEMMs); in fp16 it is multiplied by ``2^15`` so small probabilities stay normal. Every GEMM
outputs fp32 (no reduced-precision bf16 reduction); ``1/n_valid``, ``grad_output`` and the fp16
factor are applied in fp32 after the GEMMs; dX and dW are rounded once. softmax is
``exp(z - max) / sum`` (a large ``lse`` would add its rounding). With per-row ``grad_output``
(reduction ``"none"``) that differs between rows, ``dh`` is still scaled after its GEMM; for
``dW`` the row factors (divided by a power of two) multiply ``h`` before its one rounding.

Deterministic: no atomics; fixed reduction orders.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .labels import LabelScan, scan_labels

DEFAULT_MEM_BUDGET = 1024 * 1024 * 1024  # lean path working memory (chosen from bench/RESULTS.md section 1)
# Fast path row chunk: fewer chunks = fewer passes over the fp32 [V, H] dW accumulator (8 V H bytes
# each); chosen from bench/RESULTS.md section 1.
FAST_CHUNK_ROWS = 3072
FAST_CHUNK_MAX_BYTES = 6 * 1024 * 1024 * 1024  # fp32 logits of one chunk (dz is written over them), at most
MIN_TILE = 2048  # smallest backward tile side at real sizes (tests lower it)
MAX_SLAB = 8192  # widest vocabulary slab of the lean tiles
FP16_DZ_SCALE = 2.0**15  # |dz| <= 1, so dz * 2^15 <= 32768 < 65504


# --------------------------------------------------------------------------- kernels
# Each program handles BLOCK_R rows: 1 on the GPU; several under the CPU interpreter, whose cost
# is per program (the same code, a wider tile).
def _block_r(t: torch.Tensor) -> int:
    return 1 if t.is_cuda else 16


@triton.jit
def _softcap(z, softcap):
    t = z / softcap
    e = tl.exp(-2.0 * tl.abs(t))
    th = (1.0 - e) / (1.0 + e)
    th = tl.where(t < 0, -th, th)
    return softcap * th, th


@triton.jit
def _stats_kernel(
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
            z, _ = _softcap(z, softcap)
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
        zy, _ = _softcap(zy, softcap)
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
def _dz_values(z, m, inv_s, softcap, off_target, out_scale, dz_ptr, HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr):
    """The dz block of :func:`_dz_kernel` from fp32 logits ``z`` and the rows' max ``m`` and ``1 / sum``, rounded once
    to dz's dtype (bf16 to nearest even by hand: the GPU's cast gives the same bits, the interpreter's truncates)."""
    if HAS_SOFTCAP:
        zc, th = _softcap(z, softcap)
    else:
        zc = z
    g = tl.exp(zc - m[:, None]) * inv_s[:, None] - off_target
    if HAS_SOFTCAP:
        g = g * (1.0 - th * th)
    return _round_to(g * out_scale, dz_ptr, IS_BF16)


@triton.jit
def _round_to(g, dst_ptr, IS_BF16: tl.constexpr):
    """fp32 ``g`` rounded once to the dtype of ``dst_ptr``; bf16 to nearest even by hand (the GPU's cast gives the same
    bits, the interpreter's truncates)."""
    if IS_BF16:
        bits = g.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return g.to(dst_ptr.dtype.element_ty)


@triton.jit
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
    out = _dz_values(z, m, inv_s, softcap, off_target, out_scale, dz_ptr, HAS_SOFTCAP, IS_BF16)
    tl.store(dz_ptr + r64 * stride_dz + cols[None, :], out, mask=mask)


@triton.jit
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
        out = _dz_values(z, m, inv_s, softcap, off_target, out_scale, dz_ptr, HAS_SOFTCAP, IS_BF16)
        tl.debug_barrier()
        tl.store(dz_ptr + r64 * stride_dz + cols[None, :], out, mask=mask)


@triton.jit
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


def _rows_axpy(dst, dst_rows, src, src_rows, coef, starts):
    """See :func:`_rows_axpy_kernel`; ``dst`` fp32, ``len(dst_rows) + 1 == len(starts)``."""
    n_dst = dst_rows.numel()
    if n_dst == 0:
        return
    br = _block_r(dst)
    block = min(1024, triton.next_power_of_2(dst.shape[1]))
    _rows_axpy_kernel[(triton.cdiv(n_dst, br), triton.cdiv(dst.shape[1], block))](
        dst, dst.stride(0), dst_rows, src, src.stride(0), src_rows, coef, starts, n_dst, dst.shape[1],
        BLOCK_R=br, BLOCK=block, num_warps=4,
    )


@triton.jit
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


def _scale_cast(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, dst_rows: torch.Tensor | None = None):
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


# --------------------------------------------------------------------------- matmul helpers
def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with fp32 output (cuBLAS low-precision operands, fp32 accumulation and output)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)  # CPU has no mixed-dtype mm


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _dz_scale(dtype: torch.dtype) -> float:
    return FP16_DZ_SCALE if dtype == torch.float16 else 1.0


# --------------------------------------------------------------------------- planning
def lean_bytes(n_valid: int, h: int, v_s: int, r: int, *, need_h: bool, need_w: bool, gather: bool,
               row_scaled: bool = False, elt: int = 2) -> int:
    """Bytes the lean backward holds at its peak for tiles ``(v_s, r)``, beyond its inputs and the
    gradients it returns: dh accumulator, fp32 logits + dz tile, fp32 dW slab, gathered rows
    (``gather``), row-scaled rows for dW (``row_scaled``), per-row fp32 vectors."""
    total = 4 * n_valid * h if need_h else 0
    total += (4 + elt) * r * v_s
    if need_w:
        total += 4 * v_s * h
    if gather:
        total += elt * r * h
    if row_scaled and need_w:
        total += elt * r * h
    return total + 32 * n_valid


def _pow2_down(top: int, bottom: int) -> list[int]:
    out, x = [], top
    while x >= bottom:
        out.append(x)
        x //= 2
    return out or [top]


def plan_tiles(n_valid: int, h: int, v: int, *, need_h: bool = True, need_w: bool = True, all_valid: bool = False,
               row_scaled: bool = False, elt: int = 2, mem_budget: int = DEFAULT_MEM_BUDGET,
               min_tile: int | None = None) -> tuple[int, int]:
    """Lean tiles ``(v_s, R)`` within ``mem_budget`` (see :func:`lean_bytes`), the one with the
    least fp32 accumulator traffic (``dh`` re-read per slab, ``dW`` slab per row block) plus a
    per-tile charge. Tiles never go below ``min_tile`` (``MIN_TILE``; smaller GEMMs fall off the
    matmul roof): when even those exceed the budget -- the dh accumulator alone is ``4 N_v H`` --
    the smallest such tiles are used."""
    min_tile = MIN_TILE if min_tile is None else min_tile
    n_valid = max(n_valid, 1)
    vmax = min(MAX_SLAB, triton.next_power_of_2(v))
    slabs = _pow2_down(vmax, min(min_tile, vmax))
    rows = [n_valid] + [x for x in _pow2_down(8192, min_tile) if x < n_valid]
    best = None
    for v_s in slabs:
        for r in rows:
            gather = not all_valid
            mem = lean_bytes(n_valid, h, v_s, r, need_h=need_h, need_w=need_w, gather=gather, row_scaled=row_scaled,
                             elt=elt)
            n_slabs, n_blocks = math.ceil(v / v_s), math.ceil(n_valid / r)
            traffic = (8 * n_valid * h * n_slabs if need_h else 0) + (8 * v * h * n_blocks if need_w else 0)
            traffic += n_slabs * n_blocks * (16 << 20)
            key = (mem > mem_budget, mem if mem > mem_budget else traffic)
            if best is None or key < best[0]:
                best = (key, v_s, r)
    return best[1], best[2]


# --------------------------------------------------------------------------- shared pieces
def _gather(hidden: torch.Tensor, idx: torch.Tensor, all_valid: bool, rows: slice, whole: bool) -> torch.Tensor:
    if all_valid:
        return hidden if whole else hidden[rows]
    return hidden.index_select(0, idx[rows])


def _finish(m, s, tgt, zsum, eps: float, v: int):
    """(lse, per-row loss, 1/s) from the row max ``m``, sum exp(z - m) ``s``, target logit and sum of
    logits. loss = lse - (1 - eps) z_y - eps * mean(z) (PyTorch's label smoothing), computed as
    ``(m - z_y) + log s`` so a large ``lse`` adds no rounding."""
    log_s = torch.log(s)
    if eps == 0.0:
        loss = (m - tgt) + log_s
    else:
        loss = (1.0 - eps) * (m - tgt) + eps * (m - zsum / v) + log_s
    return m + log_s, loss, 1.0 / s


def _lean_forward(hidden, weight, idx, y_valid, all_valid, softcap, eps, v_s, r):
    """(lse, per-row loss, target logit, max, 1/sum) of the valid rows, walking the (R, v_s) tiles
    rows-outer."""
    n_valid, v = idx.numel(), weight.shape[0]
    dev = hidden.device
    m = torch.full((n_valid,), float("-inf"), device=dev, dtype=torch.float32)
    s = torch.zeros(n_valid, device=dev, dtype=torch.float32)
    t = torch.zeros(n_valid, device=dev, dtype=torch.float32)
    zs = torch.zeros(n_valid, device=dev, dtype=torch.float32) if eps else t
    one_block = r >= n_valid
    for r0 in range(0, n_valid, r):
        rows = slice(r0, r0 + r)
        h_r = _gather(hidden, idx, all_valid, rows, one_block)
        for s0 in range(0, v, v_s):
            w_s = weight[s0 : s0 + v_s]
            z = _mm_f32(h_r, w_s.t())
            block = min(2048, triton.next_power_of_2(z.shape[1]))
            br = _block_r(z)
            _stats_kernel[(triton.cdiv(z.shape[0], br), 1)](
                z, z.stride(0), y_valid[rows], m[rows], s[rows], t[rows], zs[rows], 1, z.shape[0], z.shape[1],
                z.shape[1], s0, float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, SMOOTH=bool(eps),
                ACCUMULATE=True, BLOCK_R=br, BLOCK=block, num_warps=8 if block >= 1024 else 4,
            )
            del z
        del h_r
    lse, loss, inv_s = _finish(m, s, t, zs, eps, v)
    return lse, loss, t, m, inv_s


def _chunk_stats(z, y_c, softcap, eps):
    """(max, sum exp(z - max), target logit, sum of logits) of fp32 logits ``z`` [c, V] (all of V),
    split over columns."""
    rows, n_cols = z.shape
    block = min(2048, triton.next_power_of_2(n_cols))
    splits = max(1, min(16, triton.cdiv(n_cols, 8192)))
    per_split = triton.cdiv(triton.cdiv(n_cols, splits), block) * block
    splits = triton.cdiv(n_cols, per_split)
    part = torch.empty(4, rows, splits, device=z.device, dtype=torch.float32)
    br = _block_r(z)
    _stats_kernel[(triton.cdiv(rows, br), splits)](
        z, z.stride(0), y_c, part[0], part[1], part[2], part[3], splits, rows, n_cols, per_split, 0,
        float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, SMOOTH=bool(eps), ACCUMULATE=False, BLOCK_R=br,
        BLOCK=block, num_warps=8 if block >= 1024 else 4,
    )
    m_max = part[0].max(dim=1, keepdim=True).values
    s = (part[1] * torch.exp(part[0] - m_max)).sum(dim=1)
    return m_max.squeeze(1), s, part[2].sum(dim=1), part[3].sum(dim=1) if eps else None


def _launch_dz(z, dz, m, inv_s, softcap, eps, v, out_scale):
    block = min(1024, triton.next_power_of_2(z.shape[1]))
    br = _block_r(z)
    _dz_kernel[(triton.cdiv(z.shape[0], br), triton.cdiv(z.shape[1], block))](
        z, z.stride(0), dz, dz.stride(0), m, inv_s, z.shape[0], z.shape[1], float(softcap or 1.0), eps / v, out_scale,
        HAS_SOFTCAP=softcap is not None, IS_BF16=dz.dtype == torch.bfloat16, BLOCK_R=br, BLOCK=block, num_warps=4,
    )


def _dz_over(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dz view written over the fp32 logits ``z`` [c, V]: the first V 16-bit values of each row (row stride 2V),
    or ``z`` itself in fp32."""
    return z if dtype == torch.float32 else z.view(dtype)[:, : z.shape[1]]


def _launch_dz_inplace(z, dz, m, inv_s, softcap, eps, v, out_scale):
    block = min(1024, triton.next_power_of_2(z.shape[1]))
    br = _block_r(z)
    _dz_inplace_kernel[(triton.cdiv(z.shape[0], br),)](
        z, z.stride(0), dz, dz.stride(0), m, inv_s, z.shape[0], z.shape[1], float(softcap or 1.0), eps / v, out_scale,
        HAS_SOFTCAP=softcap is not None, IS_BF16=dz.dtype == torch.bfloat16, BLOCK_R=br, BLOCK=block, num_warps=8,
    )


def _target_coef(t, softcap, eps, out_scale):
    """d(loss_i)/d(z_i,y) without the softmax part, times out_scale: -(1 - eps) [* (1 - th_y^2)]."""
    a = torch.full_like(t, -(1.0 - eps) * out_scale)
    if softcap is not None:
        a = a * (1.0 - (t / softcap) ** 2)
    return a


class _Targets:
    """The target term of the gradient, added in fp32 outside the low-precision dz:
    ``dh_i += a_i W[y_i]`` and ``dW[j] += sum_{i: y_i = j} a_i h_i`` (rows summed in a fixed order).
    Its index comes from :func:`.labels.scan_labels` (the call's one host sync, before any GEMM is queued); the
    coefficients come later with :meth:`coef`."""

    def __init__(self, scan: LabelScan):
        self.y = scan.y_valid
        self.perm, self.src_rows = scan.sorted.perm, scan.sorted.src_rows
        self.labels, self.starts = scan.sorted.labels, scan.sorted.starts
        self.a = self.coef_w = None

    @staticmethod
    def wanted(eps, needed) -> bool:
        """Whether a target term will be added when some row is labelled: ``eps < 1`` and a gradient wanted."""
        return eps < 1.0 and needed

    @classmethod
    def of(cls, scan: LabelScan, eps, needed) -> "_Targets | None":
        """The target term's index when it will be added (some row labelled, :meth:`wanted`), else None."""
        return cls(scan) if scan.n_valid and cls.wanted(eps, needed) else None

    def coef(self, a, row_w=None) -> "_Targets":
        """Set ``a_i`` (and the rows' factors for dW, ``row_w``)."""
        self.a = a.contiguous()
        self.coef_w = (a if row_w is None else a * row_w).index_select(0, self.perm).contiguous()
        return self

    def add_dh(self, dh_acc, weight):
        n = dh_acc.shape[0]
        ar = torch.arange(n + 1, device=dh_acc.device)
        _rows_axpy(dh_acc, ar[:n], weight, self.y, self.a, ar)

    def slab_bounds(self, v, v_s):
        edges = torch.arange(0, v + v_s, v_s, device=self.labels.device)
        return torch.searchsorted(self.labels, edges).tolist()

    def add_dw(self, dw_acc, hidden, lo, hi, s0):
        _rows_axpy(dw_acc, self.labels[lo:hi] - s0, hidden, self.src_rows, self.coef_w, self.starts[lo : hi + 1])


def _outputs(loss_rows, lse, idx, n, all_valid, reduction):
    """(loss, lse [N]) from the valid rows' values; ignored rows get 0 in both."""
    n_valid = idx.numel()
    if reduction == "none":
        loss = loss_rows if all_valid else loss_rows.new_zeros(n).index_copy_(0, idx, loss_rows)
    else:
        loss = loss_rows.sum()
        if reduction == "mean":
            loss = loss / max(n_valid, 1)
    lse_full = lse if all_valid else lse.new_zeros(n).index_copy_(0, idx, lse)
    return loss, lse_full


def _scaled_rows(raw, scale, idx, all_valid, n, dtype):
    """dh [N, H] in ``dtype``: the valid rows' fp32 ``raw`` times ``scale`` (0-d or per row), rounded once; 0 on
    ignored rows."""
    dh = (torch.empty if all_valid else torch.zeros)(n, raw.shape[1], device=raw.device, dtype=dtype)
    return _scale_cast(raw, scale, dh, None if all_valid else idx)


def _row_coefficients(grad_loss, idx, all_valid, reduction, n_valid):
    """fp32 grad_output per valid row: a 0-d tensor when uniform, else [N_v]."""
    g = grad_loss.float()
    if reduction != "none":
        return g / max(n_valid, 1) if reduction == "mean" else g
    c = g if all_valid else g.index_select(0, idx)
    if bool((c == c[0]).all()):
        return c[0]
    return c


# --------------------------------------------------------------------------- autograd
def _full_weight(weight: torch.Tensor, frozen: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(the weight the logits use, the first of its columns that gets a gradient): ``[frozen, weight]`` side by side
    when a frozen part is given (a LoRA head's base weight beside lora_B: only ``weight``'s columns are
    differentiated, ``2 N_v H_t V`` flops for dW instead of ``2 N_v H V``)."""
    if frozen is None:
        return weight, 0
    return torch.cat([frozen, weight], dim=1), frozen.shape[1]


class _LeanFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, cfg):  # the labels come in as their scan
        scan, reduction, softcap, eps, budget, frozen = cfg
        n, h = hidden.shape
        v = weight.shape[0]
        w_full, col0 = _full_weight(weight, frozen)
        idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
        if isinstance(budget, tuple):
            v_s, r = (max(1, t) for t in budget)
        else:
            v_s, r = plan_tiles(n_valid, h, v, need_h=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[1],
                                all_valid=all_valid, row_scaled=reduction == "none", elt=hidden.element_size(),
                                mem_budget=budget)
        r = min(r, max(n_valid, 1))
        ctx.targets = _Targets.of(scan, eps, any(ctx.needs_input_grad[:2]))
        # the lean slab depends on n_valid: its bounds are this path's second host sync, still before any GEMM
        ctx.bounds = ctx.targets.slab_bounds(v, v_s) if ctx.targets is not None and ctx.needs_input_grad[1] else None
        lse, loss_rows, tgt, m, inv_s = _lean_forward(hidden, w_full, idx, y_valid, all_valid, softcap, eps, v_s, r)
        ctx.save_for_backward(hidden, w_full, idx, y_valid, m, inv_s, tgt)
        ctx.cfg = (reduction, softcap, eps, v_s, r, all_valid, col0)
        ctx.set_materialize_grads(False)
        loss, lse_full = _outputs(loss_rows, lse, idx, n, all_valid, reduction)
        ctx.mark_non_differentiable(lse_full)
        return loss, lse_full

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        with torch.autocast(device_type=ctx.saved_tensors[0].device.type, enabled=False):
            dh, dw = _lean_backward(ctx, grad_loss)
        return dh, dw, None


def _lean_backward(ctx, grad_loss):
    hidden, weight, idx, y_valid, m, inv_s, tgt = ctx.saved_tensors  # weight: the full one (frozen columns first)
    reduction, softcap, eps, v_s, r, all_valid, col0 = ctx.cfg
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    h = hidden.shape[1]
    v = weight.shape[0]
    n_valid = int(idx.numel())
    w_cols = weight[:, col0:]  # the columns that get a gradient
    if grad_loss is None or n_valid == 0 or not (need_h or need_w):
        return (torch.zeros_like(hidden) if need_h else None), (torch.zeros_like(w_cols) if need_w else None)
    dtype = hidden.dtype
    S = _dz_scale(dtype)
    c = _row_coefficients(grad_loss, idx, all_valid, reduction, n_valid)
    uniform = c.dim() == 0
    c_w = None
    if uniform:
        w_post = c / S
    else:  # dW: rows scaled by c / 2^k (|c / 2^k| <= 1) before their one rounding, 2^k / S after the GEMM
        k = torch.frexp(c.abs().max())[1]
        pow2 = torch.ldexp(torch.ones((), device=c.device), k)
        c_w = c / pow2
        w_post = pow2 / S
    targets, bounds = ctx.targets, ctx.bounds  # built in forward, before its GEMMs
    if targets is not None:
        targets.coef(_target_coef(tgt, softcap, eps, S), c_w)
    dh_acc = torch.zeros(n_valid, h, device=hidden.device, dtype=torch.float32) if need_h else None
    dw = torch.empty(w_cols.shape, device=weight.device, dtype=weight.dtype) if need_w else None
    one_block = r >= n_valid
    h_all = _gather(hidden, idx, all_valid, slice(0, n_valid), True) if one_block else None
    for s0 in range(0, v, v_s):
        w_s = weight[s0 : s0 + v_s]
        dw_slab = None
        for r0 in range(0, n_valid, r):
            rows = slice(r0, r0 + r)
            h_r = h_all if one_block else _gather(hidden, idx, all_valid, rows, False)
            z = _mm_f32(h_r, w_s.t())
            dz = torch.empty(z.shape, device=z.device, dtype=dtype)
            _launch_dz(z, dz, m[rows], inv_s[rows], softcap, eps, v, S)
            del z
            if need_h:
                _addmm_f32_(dh_acc[rows], dz, w_s)
            if need_w:
                h_w = h_r[:, col0:] if uniform else (h_r[:, col0:] * c_w[rows].unsqueeze(1)).to(dtype)
                if dw_slab is None:
                    dw_slab = _mm_f32(dz.t(), h_w)
                else:
                    _addmm_f32_(dw_slab, dz.t(), h_w)
                del h_w
            del dz, h_r
        if need_w:
            if bounds is not None:
                k0 = s0 // v_s
                targets.add_dw(dw_slab, hidden[:, col0:], bounds[k0], bounds[k0 + 1], s0)
            _scale_cast(dw_slab, w_post, dw[s0 : s0 + v_s])
            del dw_slab
    del h_all
    dh = None
    if need_h:
        if targets is not None:
            targets.add_dh(dh_acc, weight)
        dh = _scaled_rows(dh_acc, c / S, idx, all_valid, hidden.shape[0], dtype)
    return dh, dw


class _FastFLCE(torch.autograd.Function):
    """Gradients in forward (``6 N_v H V``): per chunk of ``c`` valid rows, fp32 logits ``[c, V]``
    -> lse -> dz -> ``dh_c = dz @ W`` and ``dW += dz^T h_c``, both fp32; backward multiplies by
    ``grad_output / n_valid`` (fp32) and rounds once."""

    @staticmethod
    def forward(ctx, hidden, weight, cfg):  # the labels come in as their scan
        scan, reduction, softcap, eps, chunk_rows, frozen = cfg
        n, h = hidden.shape
        v = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_shape = weight.shape
        weight, col0 = _full_weight(weight, frozen)
        idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
        dtype = ctx.dtype = hidden.dtype
        S = _dz_scale(dtype)
        dh_raw = torch.empty(n_valid, h, device=hidden.device, dtype=torch.float32) if need_h else None
        dw_raw = torch.empty(w_shape, device=weight.device, dtype=torch.float32) if need_w and n_valid else None
        lse = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        loss_rows = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        tgt = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        c = max(1, min(n_valid, chunk_rows))
        targets = _Targets.of(scan, eps, need_h or need_w)
        wt = weight.t()
        z_buf = torch.empty(c, v, device=hidden.device, dtype=torch.float32) if n_valid else None
        for s0 in range(0, n_valid, c):
            rows = slice(s0, s0 + c)
            h_c = _gather(hidden, idx, all_valid, rows, False)
            y_c = y_valid[rows]
            z = _mm_f32(h_c, wt, out=z_buf[: h_c.shape[0]])
            m_c, s_c, t_c, zs_c = _chunk_stats(z, y_c, softcap, eps)
            lse[rows], loss_rows[rows], inv_s_c = _finish(m_c, s_c, t_c, zs_c, eps, v)
            tgt[rows] = t_c
            dz = _dz_over(z, dtype)  # written over the logits: one [c, V] fp32 buffer in all
            _launch_dz_inplace(z, dz, m_c, inv_s_c, softcap, eps, v, S)
            del z
            if need_h:
                _mm_f32(dz, weight, out=dh_raw[rows])
            if need_w and s0 == 0:  # the first chunk writes the accumulator (no 4 V H-byte fill)
                _mm_f32(dz.t(), h_c[:, col0:], out=dw_raw)
            elif need_w:
                _addmm_f32_(dw_raw, dz.t(), h_c[:, col0:])
            del dz, h_c
        del z_buf
        if targets is not None:
            targets.coef(_target_coef(tgt, softcap, eps, S))
            if need_h:
                targets.add_dh(dh_raw, weight)
            if need_w:
                targets.add_dw(dw_raw, hidden[:, col0:], 0, targets.labels.numel(), 0)
        ctx.save_for_backward(*(x for x in (dh_raw, dw_raw, idx) if x is not None))
        ctx.cfg = (need_h, need_w, reduction, all_valid, n, S)
        ctx.h, ctx.w_shape = h, w_shape
        ctx.set_materialize_grads(False)
        loss, lse_full = _outputs(loss_rows, lse, idx, n, all_valid, reduction)
        ctx.mark_non_differentiable(lse_full)
        return loss, lse_full

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        saved = list(ctx.saved_tensors)
        need_h, need_w, reduction, all_valid, n, S = ctx.cfg
        dh_raw = saved.pop(0) if need_h else None
        idx = saved.pop()
        dw_raw = saved.pop() if need_w and idx.numel() else None
        if grad_loss is None:
            return None, None, None
        n_valid = int(idx.numel())
        if n_valid == 0:  # nothing labelled: zero gradients whatever grad_output is (sum / 0 gives inf)
            return (torch.zeros(n, ctx.h, device=idx.device, dtype=ctx.dtype) if need_h else None), (
                torch.zeros(ctx.w_shape, device=idx.device, dtype=ctx.dtype) if need_w else None), None
        scale = grad_loss.float() / (S * (max(n_valid, 1) if reduction == "mean" else 1))
        dh = dw = None
        if dw_raw is not None:
            dw = _scale_cast(dw_raw, scale, torch.empty(dw_raw.shape, device=dw_raw.device, dtype=ctx.dtype))
        if dh_raw is not None:
            dh = _scaled_rows(dh_raw, scale, idx, all_valid, n, ctx.dtype)
        return dh, dw, None


def _forward_only(hidden, weight, scan, reduction, softcap, eps, mem_budget, frozen=None):
    weight = _full_weight(weight, frozen)[0]
    n, h = hidden.shape
    v = weight.shape[0]
    idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
    if isinstance(mem_budget, tuple):
        v_s, r = mem_budget
    else:
        v_s, r = plan_tiles(n_valid, h, v, need_h=False, need_w=False, all_valid=all_valid,
                            elt=hidden.element_size(), mem_budget=mem_budget)
    lse, loss_rows, *_ = _lean_forward(hidden, weight, idx, y_valid, all_valid, softcap, eps, v_s, min(r, max(n_valid, 1)))
    return _outputs(loss_rows, lse, idx, n, all_valid, reduction)


def _stored_fits(scan, weight, elt, tiles) -> bool:  # (called with gradients on)
    from .triton_rows import stored_fits

    return tiles is not None or stored_fits(scan.n_valid, weight.shape[0], elt, need_w=weight.requires_grad)


def fused_linear_cross_entropy_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    mem_budget: int = DEFAULT_MEM_BUDGET,
    tiles: tuple[int, int, int] | None = None,
    fast: bool = False,
    frozen_weight: torch.Tensor | None = None,
):
    """Triton backend of :func:`llamafactory_liger_fsdp.ops.fused_linear_cross_entropy` (``frozen_weight`` as there;
    labels outside ``[0, V)`` raise its ``ValueError`` from :func:`.labels.scan_labels`, the call's one host sync).
    ``tiles=(c, v_s, R)`` overrides the planning (``c``: fast path row chunk; ``(v_s, R)``: lean tiles) so tests reach
    every loop path.

    Without a gradient to compute (grad mode off, or neither input requires grad) only the
    forward runs (lean tiles, ``2 N_v H V`` flops, no gradient buffers), for both variants."""
    eps = float(label_smoothing)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
        frozen = None if frozen_weight is None else frozen_weight.detach().contiguous()
        lean_tiles = mem_budget if tiles is None else (tiles[1], tiles[2])
        grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        v = weight.shape[0]
        # the per-row path's dW slab is known now, so its slab bounds join the one host sync
        rows_slab = None
        if grads and fast and reduction == "none" and weight.requires_grad:
            from .triton_rows import dw_slab

            rows_slab = dw_slab(tiles)
        scan = scan_labels(labels, v, ignore_index, want_sorted=grads and _Targets.wanted(eps, True), slab=rows_slab)
        if not grads:
            loss, lse = _forward_only(hidden, weight, scan, reduction, softcap, eps, lean_tiles, frozen)
        elif fast and reduction == "none" and _stored_fits(scan, weight, hidden.element_size(), tiles):
            from .triton_rows import stored_dz_flce

            loss, lse = stored_dz_flce(hidden, weight, scan, softcap, eps, tiles, frozen)
        elif fast and reduction != "none":
            if tiles is None:
                cap = FAST_CHUNK_MAX_BYTES // (4 * v)
                chunk_rows = max(16, min(FAST_CHUNK_ROWS, cap // 16 * 16))
            else:
                chunk_rows = tiles[0]
            loss, lse = _FastFLCE.apply(hidden, weight, (scan, reduction, softcap, eps, chunk_rows, frozen))
        else:
            loss, lse = _LeanFLCE.apply(hidden, weight, (scan, reduction, softcap, eps, lean_tiles, frozen))
    return (loss, lse) if return_lse else loss

