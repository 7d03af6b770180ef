"""Triton fused linear cross-entropy, with the matmuls on cuBLAS: :func:`fused_linear_cross_entropy_triton` chooses
among the lean path (:mod:`.triton_lean`), the fast path (:mod:`.triton_fast`) and the per-row path
(:mod:`.triton_rows`); the kernels are in :mod:`.triton_kernels`, the pieces the paths share in :mod:`.triton_common`.

Counts for N rows, H hidden, V vocab; N_v = rows whose label is not ignored (only those are
ever multiplied: at 25% ignored labels the ``8 N_v H V`` flops of the lean path equal the
``6 N H V`` of the three unfused matmuls).

* **Lean** (``triton``, :mod:`.triton_lean`): forward and backward walk the same tiles -- ``R`` valid rows x a
  vocabulary slab of ``v_s`` head rows. Forward: ``z = h_r @ W_s^T`` in fp32 (bf16 operands,
  fp32 output), :func:`.triton_kernels.stats_kernel` folds each tile into running per-row (max, sum exp,
  target logit, sum of logits); only those ``[N_v]`` vectors are kept. Backward recomputes each
  tile with the *same* GEMM (same shapes and operands, so bitwise the same logits as forward),
  :func:`.triton_kernels.launch_dz` writes ``dz = softmax - eps/V`` in the input dtype, ``dh_acc += dz @ W_s``
  and ``dW_s += dz^T @ h_r`` in fp32, and :class:`.triton_common.Targets` adds the target term. Memory:
  ``4 N_v H`` (dh accumulator) + ``6 R v_s`` (fp32 logits + bf16 dz) + ``4 v_s H`` (dW slab) + gathered rows;
  tiles are chosen from ``mem_budget`` by :func:`.triton_lean.plan_tiles`. On Hopper at H <= 4096 both GEMMs that
  form logits are :mod:`.triton_fused`'s: the forward's keeps only the statistics, the backward's writes dz (no fp32
  tile; the same kernel and tiles, so the same logits).
* **Fast** (``triton_fast``, :mod:`.triton_fast`): gradients computed in forward for chunks of ``c`` rows x all of
  V (``6 N_v H V``); ``dh`` [N_v, H] and ``dW`` [V, H] kept in fp32 until backward multiplies
  them by ``grad_output`` and rounds once. One ``[c, V]`` fp32 buffer per call: the chunk's logits,
  then its 16-bit dz written over them (:func:`.triton_kernels.launch_dz_inplace`). ``reduction="none"`` with
  gradients (per-row ``grad_output``, unknown in forward) keeps dz itself where it fits (:mod:`.triton_rows`), else
  uses the lean path.

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

import torch

from . import triton_common, triton_fast, triton_lean, triton_rows
from .labels import scan_labels


def _stored_fits(scan, weight, elt, tiles) -> bool:  # (called with gradients on)
    return tiles is not None or triton_rows.stored_fits(scan.n_valid, weight.shape[0], elt, need_w=weight.requires_grad)


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
    mem_budget: int | None = None,
    tiles: tuple[int, int, int] | None = None,
    fast: bool = False,
    frozen_weight: torch.Tensor | None = None,
):
    """Triton backend of :func:`llamafactory_liger_fsdp.ops.fused_linear_cross_entropy` (``frozen_weight`` as there;
    labels outside ``[0, V)`` raise its ``ValueError`` from :func:`.labels.scan_labels`, the call's one host sync).
    ``tiles=(c, v_s, R)`` overrides the planning (``c``: fast path row chunk; ``(v_s, R)``: lean tiles) so tests reach
    every loop path; ``mem_budget``: the lean path's working bytes (None: ``triton_lean.DEFAULT_MEM_BUDGET``, read at
    the call, like every size constant of ``ops/``).

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
            rows_slab = triton_rows.dw_slab(tiles)
        scan = scan_labels(labels, v, ignore_index, want_sorted=grads and triton_common.Targets.wanted(eps, True),
                           slab=rows_slab)
        if not grads:
            loss, lse = triton_lean.forward_only(hidden, weight, scan, reduction, softcap, eps, lean_tiles, frozen)
        elif fast and reduction == "none" and _stored_fits(scan, weight, hidden.element_size(), tiles):
            loss, lse = triton_rows.stored_dz_flce(hidden, weight, scan, softcap, eps, tiles, frozen)
        elif fast and reduction != "none":
            chunk_rows = triton_common.default_chunk(v) if tiles is None else tiles[0]
            loss, lse = triton_fast.fast_flce(hidden, weight, scan, reduction, softcap, eps, chunk_rows, frozen)
        else:
            loss, lse = triton_lean.lean_flce(hidden, weight, scan, reduction, softcap, eps, lean_tiles, frozen)
    return (loss, lse) if return_lse else loss
