"""Pure-torch chunked fused linear cross-entropy: the oracle and the CPU fallback.

``loss = CE(softcap(hidden @ weight.T), labels)`` without ever holding the full ``[N, V]``
logits: rows are processed in chunks of at most ``chunk_rows`` (about 256 MiB of fp32 logits
per chunk by default).

Numerics follow what the unfused model computes: each chunk's logits come out of one matmul
in the input dtype (fp32 accumulation inside, like ``lm_head``) and are upcast to fp32 before
softcap / log-softmax (like transformers' ``ForCausalLMLoss``); the logits gradient is cast back
to the input dtype before the two backward matmuls (like autograd through ``logits.float()``).
``dW`` is accumulated over chunks in fp32.

Gradients are *recomputed* in backward (one more ``hidden @ weight.T`` per chunk) instead of being
kept from forward: under FSDP the head weight is gathered again for backward anyway, and keeping
``dW`` from forward would hold a full ``[V, H]`` fp32 buffer across the whole decoder backward.
"""

from __future__ import annotations

import torch

_CHUNK_BYTES = 256 * 1024 * 1024


def _rows_per_chunk(n: int, v: int, chunk_rows: int | None) -> int:
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // (4 * max(v, 1)))
    return max(1, min(n, chunk_rows))


def _logits(h: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    z = (h @ w.t()).float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


class _TorchFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, normalize, softcap, chunk_rows):
        n, v = hidden.shape[0], weight.shape[0]
        rows = _rows_per_chunk(n, v, chunk_rows)
        valid = labels != ignore_index
        n_valid = valid.sum()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for s in range(0, n, rows):
                z = _logits(hidden[s : s + rows], weight, softcap)
                y = labels[s : s + rows]
                ok = valid[s : s + rows]
                tgt = z.gather(1, torch.where(ok, y, 0).unsqueeze(1)).squeeze(1)
                total = total + torch.where(ok, torch.logsumexp(z, dim=1) - tgt, 0.0).sum()
        denom = n_valid.clamp(min=1).float() if normalize else torch.ones((), device=hidden.device)
        ctx.save_for_backward(hidden, weight, labels, denom)
        ctx.cfg = (ignore_index, softcap, rows)
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, denom = ctx.saved_tensors
        ignore_index, softcap, rows = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        scale = (grad_out.float() / denom).to(torch.float32)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], rows):
                h = hidden[s : s + rows]
                y = labels[s : s + rows]
                ok = y != ignore_index
                z = _logits(h, weight, softcap)
                g = torch.softmax(z, dim=1)
                g[torch.arange(g.shape[0], device=g.device)[ok], y[ok]] -= 1.0
                g *= (ok.float() * scale).unsqueeze(1)
                if softcap is not None:
                    g *= 1.0 - (z / softcap) ** 2
                g = g.to(hidden.dtype)
                if need_h:
                    dh[s : s + rows] = g @ weight
                if need_w:
                    dw += (g.t() @ h).float()
        return dh, (dw.to(weight.dtype) if need_w else None), None, None, None, None, None


def fused_linear_cross_entropy_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Chunked torch implementation; see :func:`llamafactory_liger_fsdp.ops.fused_linear_cross_entropy`."""
    return _TorchFLCE.apply(hidden, weight, labels, ignore_index, reduction == "mean", softcap, chunk_rows)
