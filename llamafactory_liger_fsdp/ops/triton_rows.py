"""``triton_fast`` for ``reduction="none"`` with gradients (per-token log-probs: DPO, ORPO, SimPO, KTO).

Per-row ``grad_output`` is unknown in forward, so the fast path's ``dW = sum_i dz_i^T h_i`` cannot be formed there,
and the lean path pays for it by recomputing the logits in backward (``8 N_v H V``). Here forward keeps ``dz``
itself: per chunk of ``c`` valid rows, fp32 logits ``[c, V]`` -> statistics -> ``dz`` rounded once into a
``[N_v, V]`` buffer of the inputs' dtype, and ``dh_raw = dz @ W`` in fp32 (plus the target term). Backward scales
``dh_raw``'s rows by ``grad_output`` and forms ``dW`` per vocabulary slab from the kept ``dz`` and ``h`` rows scaled by
``grad_output / 2^k`` before their one rounding -- the lean path's exactness, in ``6 N_v H V``. It costs
``N_v V`` 16-bit values (1 GiB at 4096 rows of a 128k vocabulary), so :func:`stored_fits` admits it only within
``FAST_STORE_MAX_BYTES``; beyond that the lean path runs. With a frozen head (no dW) nothing is kept: dz is written
over the chunk's logits and only ``dh`` is formed, ``4 N_v H V``.
"""

from __future__ import annotations

import torch

from . import triton_common as tc
from . import triton_kernels as tk

FAST_STORE_MAX_BYTES = 1024 * 1024 * 1024  # the kept dz [N_v, V]; above it, the lean path (bench/RESULTS.md section 9)


def stored_fits(n_valid: int, v: int, elt: int, need_w: bool = True) -> bool:
    """Whether the kept dz fits ``FAST_STORE_MAX_BYTES``; without a weight gradient none is kept."""
    return not need_w or n_valid * v * elt <= FAST_STORE_MAX_BYTES


class _StoredDzFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, cfg):  # the labels come in as their scan
        scan, softcap, eps, chunk_rows, v_s, frozen = cfg
        n, h = hidden.shape
        v = weight.shape[0]
        dev = hidden.device
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_shape = weight.shape
        weight, col0 = tc.full_weight(weight, frozen)
        idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
        dtype = hidden.dtype
        S = tc.dz_scale(dtype)
        dz_all = torch.empty(n_valid if need_w else 0, v, device=dev, dtype=dtype)  # a frozen head keeps none
        dh_raw = torch.empty(n_valid, h, device=dev, dtype=torch.float32) if need_h else None
        lse, loss_rows, tgt = (torch.empty(n_valid, device=dev, dtype=torch.float32) for _ in range(3))
        c = max(1, min(n_valid, chunk_rows))
        # the target term's index and slab bounds: from the call's one host sync, before any GEMM is queued
        targets = tc.Targets.of(scan, eps, need_h or need_w)
        ctx.targets = targets
        ctx.bounds = scan.bounds if targets is not None and need_w else None
        z_buf = torch.empty(c, v, device=dev, dtype=torch.float32) if n_valid else None
        for s0 in range(0, n_valid, c):
            rows = slice(s0, s0 + c)
            h_c = tc.gather(hidden, idx, all_valid, rows, False)
            z = tc.mm_f32(h_c, weight.t(), out=z_buf[: h_c.shape[0]])
            m_c, s_c, t_c, zs_c = tk.chunk_stats(z, y_valid[rows], softcap, eps)
            lse[rows], loss_rows[rows], inv_s_c = tc.finish(m_c, s_c, t_c, zs_c, eps, v)
            tgt[rows] = t_c
            if need_w:
                dz = dz_all[rows]
                tk.launch_dz(z, dz, m_c, inv_s_c, softcap, eps, v, S)
            else:  # written over the logits, as in the fast path
                dz = tk.dz_over(z, dtype)
                tk.launch_dz_inplace(z, dz, m_c, inv_s_c, softcap, eps, v, S)
            if need_h:
                tc.mm_f32(dz, weight, out=dh_raw[rows])
            del dz
            del z, h_c
        del z_buf
        if need_h and targets is not None:
            targets.coef(tc.target_coef(tgt, softcap, eps, S)).add_dh(dh_raw, weight)
        ctx.save_for_backward(hidden, dz_all, tgt, idx, *([dh_raw] if need_h else []))
        ctx.cfg = (need_h, need_w, all_valid, n, S, softcap, eps, v_s, col0)
        ctx.w_shape = w_shape
        return tc.forward_outputs(ctx, loss_rows, lse, idx, n, all_valid, "none")

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        hidden, dz_all, tgt, idx, *rest = ctx.saved_tensors
        need_h, need_w, all_valid, n, S, softcap, eps, v_s, col0 = ctx.cfg
        if grad_loss is None:
            return None, None, None
        n_valid = int(idx.numel())
        dtype = hidden.dtype
        if n_valid == 0:
            return (torch.zeros_like(hidden) if need_h else None), (
                torch.zeros(ctx.w_shape, device=hidden.device, dtype=dtype) if need_w else None), None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            c = tc.row_coefficients(grad_loss, idx, all_valid, "none", n_valid)
            dh = tc.scaled_rows(rest[0], c / S, idx, all_valid, n, dtype) if need_h else None
            dw = _dw(hidden[:, col0:], dz_all, tgt, idx, c, all_valid, S, softcap, eps, v_s, ctx) if need_w else None
        return dh, dw, None


def _dw(hidden, dz_all, tgt, idx, c, all_valid, S, softcap, eps, v_s, ctx):
    """dW = dz^T (c h) per vocabulary slab, fp32, rounded once; for a per-row ``c`` the rows of ``h`` carry
    ``c / 2^k`` (|.| <= 1) into their one rounding and ``2^k / S`` is applied after the GEMM."""
    w_shape = ctx.w_shape
    v = w_shape[0]
    h_rows = tc.gather(hidden, idx, all_valid, slice(0, idx.numel()), True)
    c_w, post = tc.dw_row_factors(c, S)
    h_w = h_rows if c_w is None else (h_rows * c_w.unsqueeze(1)).to(hidden.dtype)
    targets, bounds = ctx.targets, ctx.bounds  # built in forward
    if targets is not None:
        targets.coef(tc.target_coef(tgt, softcap, eps, S), c_w)
    dw = torch.empty(w_shape, device=hidden.device, dtype=hidden.dtype)
    for k, s0 in enumerate(range(0, v, v_s)):
        slab = tc.mm_f32(dz_all[:, s0 : s0 + v_s].t(), h_w)
        if targets is not None:
            targets.add_dw(slab, hidden, bounds[k], bounds[k + 1], s0)
        tk.scale_cast(slab, post, dw[s0 : s0 + v_s])
        del slab
    return dw


def dw_slab(tiles) -> int:
    """The vocabulary slab of backward's dW GEMMs (``tiles=(c, v_s, _)`` overrides it in tests)."""
    return tc.MAX_SLAB * 2 if tiles is None else max(1, tiles[1])


def stored_dz_flce(hidden, weight, scan, softcap, eps, tiles, frozen=None):
    """(per-row loss [N], lse [N]); ``scan``: :func:`.labels.scan_labels` with this path's :func:`dw_slab`;
    ``tiles=(c, v_s, _)`` overrides the row chunk and the dW slab (tests); ``frozen``: the weight's frozen columns,
    first (see ``triton_common.full_weight``)."""
    c = tc.default_chunk(weight.shape[0]) if tiles is None else tiles[0]
    return _StoredDzFLCE.apply(hidden, weight, (scan, softcap, eps, c, dw_slab(tiles), frozen))
