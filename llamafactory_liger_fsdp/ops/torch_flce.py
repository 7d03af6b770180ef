"""Pure-torch chunked fused linear cross-entropy: the oracle and the CPU fallback.

``loss = CE(softcap(hidden @ weight.T), labels)`` without ever holding the full ``[N, V]``
logits: rows are processed in chunks of at most ``chunk_rows`` (about 256 MiB of fp32 logits
per chunk by default).

Numerics: each chunk's logits come out of one matmul of the input-dtype operands with an fp32
output (as in the Triton kernels; the unfused model rounds them to the input dtype first, one
rounding more), then softcap / log-softmax in fp32 (like transformers' ``ForCausalLMLoss``); the
logits gradient, scaled by
``grad_output`` (and ``1/n_valid``), is cast back to the input dtype before the two backward
matmuls (like autograd through ``logits.float()``). ``dW`` is accumulated over chunks in fp32.

Gradients are *recomputed* in backward (one more ``hidden @ weight.T`` per chunk), so the oracle
holds nothing but its inputs between forward and backward.
"""

from __future__ import annotations

import torch

_CHUNK_BYTES = 256 * 1024 * 1024


def _rows_per_chunk(n: int, v: int, chunk_rows: int | None) -> int:
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // (4 * max(v, 1)))
    return max(1, min(n, chunk_rows))


def _operand(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the logits matmul takes it: CPU has no 16-bit matmul with an fp32 output, so it is upcast
    once there (bf16/fp16 values are exact in fp32)."""
    return weight.float() if not weight.is_cuda and weight.dtype != torch.float32 else weight


def _logits(h: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """fp32 logits ``h @ w.T`` of the input-dtype values (``w`` from :func:`_operand`)."""
    if h.dtype == w.dtype and h.dtype != torch.float32:
        z = torch.mm(h, w.t(), out_dtype=torch.float32)
    else:
        z = h.to(w.dtype) @ w.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


class _TorchFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, cfg):
        ignore_index, reduction, softcap, eps, chunk_rows, frozen = cfg
        n, v = hidden.shape[0], weight.shape[0]
        w_shape, col0 = weight.shape, 0 if frozen is None else frozen.shape[1]
        if frozen is not None:  # [frozen, weight] side by side; only weight's columns are differentiated
            weight = torch.cat([frozen, weight], dim=1)
        rows = _rows_per_chunk(n, v, chunk_rows)
        valid = labels != ignore_index
        loss_rows = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w_op = _operand(weight)
            for s in range(0, n, rows):
                z = _logits(hidden[s : s + rows], w_op, softcap)
                ok = valid[s : s + rows]
                y = torch.where(ok, labels[s : s + rows], 0)
                lse_c = torch.logsumexp(z, dim=1)
                nll = lse_c - z.gather(1, y.unsqueeze(1)).squeeze(1)
                if eps:
                    nll = (1.0 - eps) * nll + eps * (lse_c - z.mean(dim=1))
                loss_rows[s : s + rows] = torch.where(ok, nll, 0.0)
                lse[s : s + rows] = torch.where(ok, lse_c, 0.0)
        n_valid = valid.sum()
        ctx.save_for_backward(hidden, weight, labels, n_valid)
        ctx.cfg = (ignore_index, reduction, softcap, eps, rows, col0)
        ctx.w_shape = w_shape
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        if reduction == "none":
            return loss_rows, lse
        loss = loss_rows.sum()
        return (loss / n_valid.clamp(min=1).float() if reduction == "mean" else loss), lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        hidden, weight, labels, n_valid = ctx.saved_tensors
        ignore_index, reduction, softcap, eps, rows, col0 = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_out is None:
            return None, None, None, None
        v = weight.shape[0]
        if not bool(n_valid):  # nothing labelled: zero gradients whatever grad_output is (sum / 0 gives inf)
            return (torch.zeros_like(hidden) if need_h else None), (
                torch.zeros(ctx.w_shape, dtype=weight.dtype, device=weight.device) if need_w else None), None, None
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(ctx.w_shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_out = grad_out.float()
        if reduction == "mean":
            g_out = g_out / n_valid.clamp(min=1).float()
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w_op = _operand(weight)
            for s in range(0, hidden.shape[0], rows):
                h = hidden[s : s + rows]
                y = labels[s : s + rows]
                ok = y != ignore_index
                z = _logits(h, w_op, softcap)
                g = torch.softmax(z, dim=1)
                g[torch.arange(g.shape[0], device=g.device)[ok], y[ok]] -= 1.0 - eps
                if eps:
                    g -= eps / v
                c = g_out[s : s + rows] if reduction == "none" else g_out
                g *= torch.where(ok, c, 0.0).unsqueeze(1)  # an ignored row's grad_output (inf, NaN) never enters
                if softcap is not None:
                    g *= 1.0 - (z / softcap) ** 2
                g = g.to(hidden.dtype)
                if need_h:
                    dh[s : s + rows] = g @ weight
                if need_w:
                    dw += (g.t() @ h[:, col0:]).float()
        return dh, (dw.to(weight.dtype) if need_w else None), None, None


def fused_linear_cross_entropy_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    chunk_rows: int | None = None,
    frozen_weight: torch.Tensor | None = None,
):
    """Chunked torch implementation (no label check); see
    :func:`llamafactory_liger_fsdp.ops.fused_linear_cross_entropy`."""
    frozen = None if frozen_weight is None else frozen_weight.detach()
    loss, lse = _TorchFLCE.apply(hidden, weight, labels,
                                 (ignore_index, reduction, softcap, float(label_smoothing), chunk_rows, frozen))
    return (loss, lse) if return_lse else loss
