"""The kernel seam: one function, ``fused_linear_cross_entropy``.

``ops`` knows nothing of LLaMA-Factory, PEFT or FSDP: it takes plain tensors, so the kernel can
be tested and benchmarked alone. Backends:

* ``"torch"``  -- :mod:`.torch_flce`, chunked pure torch: the oracle and the CPU fallback.
* ``"triton"`` -- :mod:`.triton_flce`, the Triton kernel (default on CUDA): lean, gradients
  recomputed in backward, a few hundred MiB beyond its inputs at 16k x 128k.
* ``"triton_fast"`` -- the same kernels with the gradients computed in forward: 25% fewer
  flops, for an fp32 ``[V, H]`` accumulator (2 GiB at 128k x 4096) plus a 1.5 GiB row chunk.
"""

from __future__ import annotations

import torch

from .torch_flce import fused_linear_cross_entropy_torch

BACKENDS = ("torch", "triton", "triton_fast")
REDUCTIONS = ("mean", "sum")


def default_backend(device: torch.device, fast: bool = False) -> str:
    """``"triton"`` (``"triton_fast"`` with ``fast``) where the Triton kernel can run (CUDA with
    triton installed), else ``"torch"``."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            from . import triton_flce  # noqa: F401
        except ImportError:
            return "torch"
        return "triton_fast" if fast else "triton"
    return "torch"


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``softcap(hidden @ weight.T)`` against ``labels`` without materialising the logits.

    Args:
        hidden: ``[N, H]`` inputs of the head (already flattened; labels already shifted).
        weight: ``[V, H]`` head weight.
        labels: ``[N]`` int64 targets; ``ignore_index`` rows contribute nothing.
        reduction: ``"mean"`` (over non-ignored rows; 0 if there are none) or ``"sum"``.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2/3).
        backend: ``"triton"``, ``"triton_fast"``, ``"torch"`` or ``None`` (triton on CUDA, torch elsewhere).

    Returns a scalar fp32 loss, differentiable in ``hidden`` and ``weight``. Under autocast both
    inputs are cast to the autocast dtype first, as ``nn.Linear`` would.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"fused_linear_cross_entropy wants hidden [N, H], weight [V, H], labels [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"fused_linear_cross_entropy: shapes do not match: hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"fused_linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"fused_linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype} (outside autocast). "
            "Cast one of them, as nn.Linear would require."
        )
    backend = backend or default_backend(hidden.device)
    if backend == "torch":
        return fused_linear_cross_entropy_torch(
            hidden, weight, labels, ignore_index=ignore_index, reduction=reduction, softcap=softcap
        )
    if backend in ("triton", "triton_fast"):
        from .triton_flce import fused_linear_cross_entropy_triton

        return fused_linear_cross_entropy_triton(
            hidden, weight, labels, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
            fast=backend == "triton_fast",
        )
    raise ValueError(f"fused_linear_cross_entropy: backend must be one of {BACKENDS} or None, got {backend!r}")


__all__ = ["fused_linear_cross_entropy", "default_backend", "BACKENDS"]
