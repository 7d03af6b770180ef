"""The lean path (``triton``): forward keeps per-row statistics only, backward recomputes each (R valid rows x v_s
vocabulary rows) tile with the same GEMM; the tiles are planned from a memory budget (:func:`plan_tiles`). Also the
forward-only call used when no gradient is wanted."""

from __future__ import annotations

import math

import torch
import triton

from . import triton_common as tc
from . import triton_fused as tf
from . import triton_kernels as tk

DEFAULT_MEM_BUDGET = 1024 * 1024 * 1024  # lean path working memory (chosen from bench/RESULTS.md section 1)
MIN_TILE = 2048  # smallest backward tile side at real sizes (tests lower it)
MAX_ROWS = 8192  # largest row block of the lean tiles
TILE_CHARGE = 16 << 20  # each tile's launch charged as this many bytes of traffic in plan_tiles


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
               row_scaled: bool = False, elt: int = 2, mem_budget: int | None = None,
               min_tile: int | None = None) -> tuple[int, int]:
    """Lean tiles ``(v_s, R)`` within ``mem_budget`` (see :func:`lean_bytes`), the one with the
    least fp32 accumulator traffic (``dh`` re-read per slab, ``dW`` slab per row block) plus a
    per-tile charge. Tiles never go below ``min_tile`` (``MIN_TILE``; smaller GEMMs fall off the
    matmul roof): when even those exceed the budget -- the dh accumulator alone is ``4 N_v H`` --
    the smallest such tiles are used."""
    min_tile = MIN_TILE if min_tile is None else min_tile
    mem_budget = DEFAULT_MEM_BUDGET if mem_budget is None else mem_budget
    n_valid = max(n_valid, 1)
    vmax = min(tc.MAX_SLAB, triton.next_power_of_2(v))
    slabs = _pow2_down(vmax, min(min_tile, vmax))
    rows = [n_valid] + [x for x in _pow2_down(MAX_ROWS, min_tile) if x < n_valid]
    best = None
    for v_s in slabs:
        for r in rows:
            gather = not all_valid
            mem = lean_bytes(n_valid, h, v_s, r, need_h=need_h, need_w=need_w, gather=gather, row_scaled=row_scaled,
                             elt=elt)
            n_slabs, n_blocks = math.ceil(v / v_s), math.ceil(n_valid / r)
            traffic = (8 * n_valid * h * n_slabs if need_h else 0) + (8 * v * h * n_blocks if need_w else 0)
            traffic += n_slabs * n_blocks * TILE_CHARGE
            key = (mem > mem_budget, mem if mem > mem_budget else traffic)
            if best is None or key < best[0]:
                best = (key, v_s, r)
    return best[1], best[2]


# --------------------------------------------------------------------------- forward and backward
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
    fused = tf.mode_for(hidden, weight)[1]
    for r0 in range(0, n_valid, r):
        rows = slice(r0, r0 + r)
        h_r = tc.gather(hidden, idx, all_valid, rows, one_block)
        if fused and _fused_stats(h_r, weight, y_valid, r0, softcap, eps, (m, s, t, zs)):
            continue  # all of V per launch: no fp32 logits written or read
        for s0 in range(0, v, v_s):
            w_s = weight[s0 : s0 + v_s]
            z = tc.mm_f32(h_r, w_s.t())
            block = min(2048, triton.next_power_of_2(z.shape[1]))
            br = tk.block_r(z)
            tk.stats_kernel[(triton.cdiv(z.shape[0], br), 1)](
                z, z.stride(0), y_valid[rows], m[rows], s[rows], t[rows], zs[rows], 1, z.shape[0], z.shape[1],
                z.shape[1], s0, float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, SMOOTH=bool(eps),
                ACCUMULATE=True, BLOCK_R=br, BLOCK=block, num_warps=8 if block >= 1024 else 4,
            )
            del z
        del h_r
    lse, loss, inv_s = tc.finish(m, s, t, zs, eps, v)
    return lse, loss, t, m, inv_s


def _fused_stats(h_r, weight, y_valid, r0, softcap, eps, out) -> bool:
    """The rows' statistics over all of V from the fused GEMM, ``tf.STATS_ROWS`` rows a launch (its per-tile partial
    statistics stay within ~16 bytes x rows x V / 256); False where it does not compile."""
    for a in range(0, h_r.shape[0], tf.STATS_ROWS):
        h_a = h_r[a : a + tf.STATS_ROWS]
        rows = slice(r0 + a, r0 + a + h_a.shape[0])
        stats = tf.logits_stats(h_a, weight, y_valid[rows], softcap, eps)
        if stats is None:  # (a compile failure: the pass starts these rows afresh)
            for dst, val in zip(out, (float("-inf"), 0.0, 0.0, 0.0)):
                dst[r0 : r0 + h_r.shape[0]] = val
            return False
        for dst, val in zip(out, stats if eps else stats[:3]):
            dst[rows] = val
    return True


class _LeanFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, cfg):  # the labels come in as their scan
        scan, reduction, softcap, eps, budget, frozen = cfg
        n, h = hidden.shape
        v = weight.shape[0]
        w_full, col0 = tc.full_weight(weight, frozen)
        idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
        if isinstance(budget, tuple):
            v_s, r = (max(1, t) for t in budget)
        else:
            v_s, r = plan_tiles(n_valid, h, v, need_h=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[1],
                                all_valid=all_valid, row_scaled=reduction == "none", elt=hidden.element_size(),
                                mem_budget=budget)
        r = min(r, max(n_valid, 1))
        ctx.targets = tc.Targets.of(scan, eps, any(ctx.needs_input_grad[:2]))
        # the lean slab depends on n_valid: its bounds are this path's second host sync, still before any GEMM
        ctx.bounds = ctx.targets.slab_bounds(v, v_s) if ctx.targets is not None and ctx.needs_input_grad[1] else None
        lse, loss_rows, tgt, m, inv_s = _lean_forward(hidden, w_full, idx, y_valid, all_valid, softcap, eps, v_s, r)
        ctx.save_for_backward(hidden, w_full, idx, y_valid, m, inv_s, tgt)
        ctx.cfg = (reduction, softcap, eps, v_s, r, all_valid, col0)
        return tc.forward_outputs(ctx, loss_rows, lse, idx, n, all_valid, reduction)

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
    S = tc.dz_scale(dtype)
    c = tc.row_coefficients(grad_loss, idx, all_valid, reduction, n_valid)
    uniform = c.dim() == 0
    c_w, w_post = tc.dw_row_factors(c, S)  # per row: dW's rows scaled by c / 2^k before their one rounding
    targets, bounds = ctx.targets, ctx.bounds  # built in forward, before its GEMMs
    if targets is not None:
        targets.coef(tc.target_coef(tgt, softcap, eps, S), c_w)
    dh_acc = torch.zeros(n_valid, h, device=hidden.device, dtype=torch.float32) if need_h else None
    dw = torch.empty(w_cols.shape, device=weight.device, dtype=weight.dtype) if need_w else None
    one_block = r >= n_valid
    fused = tf.mode_for(hidden, weight)[1]  # dz straight from the fused GEMM (the forward's logits, bitwise)
    h_all = tc.gather(hidden, idx, all_valid, slice(0, n_valid), True) if one_block else None
    for s0 in range(0, v, v_s):
        w_s = weight[s0 : s0 + v_s]
        dw_slab = None
        for r0 in range(0, n_valid, r):
            rows = slice(r0, r0 + r)
            h_r = h_all if one_block else tc.gather(hidden, idx, all_valid, rows, False)
            dz = torch.empty(h_r.shape[0], w_s.shape[0], device=h_r.device, dtype=dtype)
            if not (fused and tf.logits_dz(h_r, w_s, dz, m[rows], inv_s[rows], softcap, eps, v, S)):
                z = tc.mm_f32(h_r, w_s.t())
                tk.launch_dz(z, dz, m[rows], inv_s[rows], softcap, eps, v, S)
                del z
            if need_h:
                tc.addmm_f32_(dh_acc[rows], dz, w_s)
            if need_w:
                h_w = h_r[:, col0:] if uniform else (h_r[:, col0:] * c_w[rows].unsqueeze(1)).to(dtype)
                if dw_slab is None:
                    dw_slab = tc.mm_f32(dz.t(), h_w)
                else:
                    tc.addmm_f32_(dw_slab, dz.t(), h_w)
                del h_w
            del dz, h_r
        if need_w:
            if bounds is not None:
                k0 = s0 // v_s
                targets.add_dw(dw_slab, hidden[:, col0:], bounds[k0], bounds[k0 + 1], s0)
            tk.scale_cast(dw_slab, w_post, dw[s0 : s0 + v_s])
            del dw_slab
    del h_all
    dh = None
    if need_h:
        if targets is not None:
            targets.add_dh(dh_acc, weight)
        dh = tc.scaled_rows(dh_acc, c / S, idx, all_valid, hidden.shape[0], dtype)
    return dh, dw


def forward_only(hidden, weight, scan, reduction, softcap, eps, mem_budget, frozen=None):
    """(loss, lse [N]) without gradients: the lean forward alone (``2 N_v H V`` flops, no gradient buffers);
    ``mem_budget`` bytes or ``(v_s, R)`` tiles."""
    weight = tc.full_weight(weight, frozen)[0]
    n, h = hidden.shape
    v = weight.shape[0]
    idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
    if isinstance(mem_budget, tuple):
        v_s, r = mem_budget
    else:
        v_s, r = plan_tiles(n_valid, h, v, need_h=False, need_w=False, all_valid=all_valid,
                            elt=hidden.element_size(), mem_budget=mem_budget)
    lse, loss_rows, *_ = _lean_forward(hidden, weight, idx, y_valid, all_valid, softcap, eps, v_s, min(r, max(n_valid, 1)))
    return tc.outputs(loss_rows, lse, idx, n, all_valid, reduction)


def lean_flce(hidden, weight, scan, reduction, softcap, eps, budget, frozen=None):
    """(loss, lse [N]) with gradients recomputed in backward; ``scan``: :func:`.labels.scan_labels`; ``budget``: bytes,
    or ``(v_s, R)`` tiles (tests); ``frozen``: the weight's frozen columns, first (see ``triton_common.full_weight``)."""
    return _LeanFLCE.apply(hidden, weight, (scan, reduction, softcap, eps, budget, frozen))
