"""The fast path (``triton_fast``, reductions ``"mean"`` and ``"sum"``): gradients computed in forward for chunks of
valid rows x all of V, fp32 dh and dW held until backward multiplies them by grad_output and rounds once."""

from __future__ import annotations

import torch

from . import triton_common as tc
from . import triton_fused as tf
from . import triton_kernels as tk


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
        weight, col0 = tc.full_weight(weight, frozen)
        idx, n_valid, all_valid, y_valid = scan.idx, scan.n_valid, scan.all_valid, scan.y_valid
        dtype = ctx.dtype = hidden.dtype
        S = tc.dz_scale(dtype)
        dh_raw = torch.empty(n_valid, h, device=hidden.device, dtype=torch.float32) if need_h else None
        dw_raw = torch.empty(w_shape, device=weight.device, dtype=torch.float32) if need_w and n_valid else None
        lse = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        loss_rows = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        tgt = torch.empty(n_valid, device=hidden.device, dtype=torch.float32)
        mode = tf.mode_for(hidden, weight)[0]
        if mode == "recompute":  # 16-bit dz buffer, no fp32 logits: twice the rows in the same bytes
            chunk_rows *= tf.RECOMPUTE_ROWS_X
        c = max(1, min(n_valid, chunk_rows))
        targets = tc.Targets.of(scan, eps, need_h or need_w)
        buf = None
        if n_valid:
            buf = torch.empty(c, v, device=hidden.device, dtype=dtype if mode == "recompute" else torch.float32)
        for s0 in range(0, n_valid, c):
            rows = slice(s0, s0 + c)
            h_c = tc.gather(hidden, idx, all_valid, rows, False)
            dz, stats = _chunk_dz(h_c, weight, y_valid[rows], buf[: h_c.shape[0]], mode, softcap, eps, S)
            lse[rows], loss_rows[rows], tgt[rows] = stats
            if need_h:
                tc.mm_f32(dz, weight, out=dh_raw[rows])
            if need_w and s0 == 0:  # the first chunk writes the accumulator (no 4 V H-byte fill)
                tc.mm_f32(dz.t(), h_c[:, col0:], out=dw_raw)
            elif need_w:
                tc.addmm_f32_(dw_raw, dz.t(), h_c[:, col0:])
            del dz, h_c
        del buf
        if targets is not None:
            targets.coef(tc.target_coef(tgt, softcap, eps, S))
            if need_h:
                targets.add_dh(dh_raw, weight)
            if need_w:
                targets.add_dw(dw_raw, hidden[:, col0:], 0, targets.labels.numel(), 0)
        ctx.save_for_backward(*(x for x in (dh_raw, dw_raw, idx) if x is not None))
        ctx.cfg = (need_h, need_w, reduction, all_valid, n, S)
        ctx.h, ctx.w_shape = h, w_shape
        return tc.forward_outputs(ctx, loss_rows, lse, idx, n, all_valid, reduction)

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
            dw = tk.scale_cast(dw_raw, scale, torch.empty(dw_raw.shape, device=dw_raw.device, dtype=ctx.dtype))
        if dh_raw is not None:
            dh = tc.scaled_rows(dh_raw, scale, idx, all_valid, n, ctx.dtype)
        return dh, dw, None


def _chunk_dz(h_c, weight, y_c, buf, mode, softcap, eps, S):
    """(dz [c, V] in the inputs' dtype, (lse, loss, target logit)) of one chunk: with ``mode`` None cuBLAS's fp32
    logits in ``buf``, the statistics pass and dz written over them; "stats": the fused GEMM writes the logits and
    their statistics, then the same dz pass; "recompute" (``buf`` 16-bit): the fused GEMM's statistics, then the
    fused GEMM again writing dz into ``buf`` (a compile failure falls back to cuBLAS, logged once)."""
    v = weight.shape[0]
    stats = None
    if mode == "stats":
        stats = tf.logits_stats(h_c, weight, y_c, softcap, eps, z_out=buf)
    elif mode == "recompute":
        stats = tf.logits_stats(h_c, weight, y_c, softcap, eps)
    z = None
    if stats is None:
        z = tc.mm_f32(h_c, weight.t(), out=None if mode == "recompute" else buf)
        stats = tk.chunk_stats(z, y_c, softcap, eps)
    m_c, s_c, t_c, zs_c = stats
    lse_c, loss_c, inv_s_c = tc.finish(m_c, s_c, t_c, zs_c, eps, v)
    if mode == "recompute":
        dz = buf
        if z is not None or not tf.logits_dz(h_c, weight, dz, m_c, inv_s_c, softcap, eps, v, S):
            z = tc.mm_f32(h_c, weight.t()) if z is None else z
            tk.launch_dz(z, dz, m_c, inv_s_c, softcap, eps, v, S)
    else:
        z = buf
        dz = tk.dz_over(z, h_c.dtype)  # written over the logits: one [c, V] fp32 buffer in all
        tk.launch_dz_inplace(z, dz, m_c, inv_s_c, softcap, eps, v, S)
    return dz, (lse_c, loss_c, t_c)


def fast_flce(hidden, weight, scan, reduction, softcap, eps, chunk_rows, frozen=None):
    """(loss, lse [N]) with the gradients formed in forward, ``chunk_rows`` valid rows at a time; ``scan``:
    :func:`.labels.scan_labels`; ``frozen``: the weight's frozen columns, first (see ``triton_common.full_weight``)."""
    return _FastFLCE.apply(hidden, weight, (scan, reduction, softcap, eps, chunk_rows, frozen))
