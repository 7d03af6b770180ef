"""The kernel seam: one function, ``fused_linear_cross_entropy``.

``ops`` knows nothing of LLaMA-Factory, PEFT or FSDP: it takes plain tensors, so the kernel can
be tested and benchmarked alone. Backends:

* ``"torch"``  -- :mod:`.torch_flce`, chunked pure torch: the oracle and the CPU fallback.
* ``"triton"`` -- :mod:`.triton_flce`, the Triton kernel (default on CUDA): lean, gradients
  recomputed in backward, within ``DEFAULT_MEM_BUDGET`` (1 GiB) beyond its inputs where the
  dh accumulator ``4 N_v H`` leaves room.
* ``"triton_fast"`` -- the same kernels with the gradients computed in forward: 25% fewer
  flops, for fp32 ``[V, H]`` and ``[N_v, H]`` gradients held until backward plus a row chunk of
  fp32 logits and dz (3072 rows: 2.2 GiB at V = 128k).
"""

from __future__ import annotations

import torch

from .labels import label_error, out_of_range
from .torch_flce import fused_linear_cross_entropy_torch

BACKENDS = ("torch", "triton", "triton_fast")
REDUCTIONS = ("mean", "sum", "none")


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


def check_labels(labels: torch.Tensor, v: int, ignore_index: int = -100) -> None:
    """Raise one ``ValueError`` naming the first label outside ``[0, v)`` that is not ``ignore_index``
    (a device-side gather would assert instead, leaving the CUDA context unusable). The Triton backends make the same
    check inside their one host sync (:func:`.labels.scan_labels`)."""
    bad = out_of_range(labels, v, labels != ignore_index)
    if bool(bad.any()):
        raise label_error(labels, v, ignore_index, bad)


def _check_arguments(hidden, weight, labels, frozen_weight, reduction, label_smoothing, softcap) -> None:
    """ValueError naming what is wrong with the arguments, before any kernel runs."""
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"fused_linear_cross_entropy wants hidden [N, H], weight [V, H], labels [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    h_f = 0 if frozen_weight is None else frozen_weight.shape[1]
    if (hidden.shape[1] != h_f + weight.shape[1] or hidden.shape[0] != labels.shape[0]
            or (frozen_weight is not None and (frozen_weight.dim() != 2 or frozen_weight.shape[0] != weight.shape[0]))):
        frozen = "" if frozen_weight is None else f", frozen_weight {tuple(frozen_weight.shape)}"
        raise ValueError(
            f"fused_linear_cross_entropy: shapes do not match: hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}{frozen}, labels {tuple(labels.shape)}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"fused_linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"fused_linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be > 0 or None, got {softcap!r}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"fused_linear_cross_entropy: labels must be integers, got {labels.dtype}")


def _operands(hidden, weight, frozen_weight):
    """The operands as the GEMMs take them: cast to the autocast dtype, as ``nn.Linear`` would; one dtype."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        frozen_weight = None if frozen_weight is None else frozen_weight.to(dtype)
    if hidden.dtype != weight.dtype or (frozen_weight is not None and frozen_weight.dtype != weight.dtype):
        raise TypeError(
            f"fused_linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}"
            f"{'' if frozen_weight is None else f' and frozen_weight {frozen_weight.dtype}'} (outside autocast). "
            "Cast one of them, as nn.Linear would require."
        )
    return hidden, weight, frozen_weight


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    frozen_weight: torch.Tensor | None = None,
):
    """Cross-entropy of ``softcap(hidden @ weight.T)`` against ``labels`` without materialising the logits.

    Args:
        hidden: ``[N, H]`` inputs of the head (already flattened; labels already shifted).
        weight: ``[V, H]`` head weight.
        labels: ``[N]`` integer targets in ``[0, V)`` or ``ignore_index`` (anything else raises
            ``ValueError`` before any kernel runs).
        reduction: ``"mean"`` (over non-ignored rows; 0 if there are none), ``"sum"``, or ``"none"``
            (``[N]`` fp32 per-row losses, 0 on ignored rows; gradients exact for any per-row
            ``grad_output``).
        label_smoothing: ``eps`` as in ``F.cross_entropy``: per row ``(1 - eps) * nll + eps *
            mean_over_classes(-log_softmax)``.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2/3).
        return_lse: also return the per-row log-sum-exp of the (softcapped) logits, ``[N]`` fp32,
            0 on ignored rows; it carries no gradient.
        backend: ``"triton"``, ``"triton_fast"``, ``"torch"`` or ``None`` (triton on CUDA, torch elsewhere).
        frozen_weight: optional ``[V, H_f]`` columns that come before ``weight``'s (``[V, H - H_f]``): the logits are
            ``hidden @ [frozen_weight, weight]^T`` and only ``weight`` is differentiated (a LoRA head's base weight
            beside lora_B: dW costs ``2 N_v (H - H_f) V`` flops instead of ``2 N_v H V``).

    Returns the fp32 loss (a scalar, or ``[N]`` for ``"none"``), differentiable in ``hidden`` and
    ``weight``; ``(loss, lse)`` with ``return_lse``. Under autocast both inputs are cast to the
    autocast dtype first, as ``nn.Linear`` would.
    """
    _check_arguments(hidden, weight, labels, frozen_weight, reduction, label_smoothing, softcap)
    backend = backend or default_backend(hidden.device)
    if backend not in BACKENDS:
        raise ValueError(f"fused_linear_cross_entropy: backend must be one of {BACKENDS} or None, got {backend!r}")
    labels = labels.long()
    if backend == "torch":
        check_labels(labels, weight.shape[0], ignore_index)
    hidden, weight, frozen_weight = _operands(hidden, weight, frozen_weight)
    kw = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": float(label_smoothing),
          "softcap": softcap, "return_lse": return_lse, "frozen_weight": frozen_weight}
    if backend == "torch":
        return fused_linear_cross_entropy_torch(hidden, weight, labels, **kw)
    from .triton_flce import fused_linear_cross_entropy_triton

    return fused_linear_cross_entropy_triton(hidden, weight, labels, fast=backend == "triton_fast", **kw)


__all__ = ["BACKENDS", "REDUCTIONS", "check_labels", "default_backend", "fused_linear_cross_entropy"]
