"""What the lean, fast and per-row paths share outside the Triton kernels: the fp32-output GEMM helpers, the fast
row chunk, the per-row scaling of dW's rows, the valid rows' gather and outputs, the loss from the row statistics,
grad_output per row, and the target term of the gradient.

The paths call :func:`mm_f32` and :func:`addmm_f32_` through this module (``triton_common.mm_f32``), so a test or a
benchmark that substitutes them here sees every GEMM.
"""

from __future__ import annotations

import torch

from . import triton_kernels as tk
from .labels import LabelScan
from .upcast import to_fp32

# Fast path row chunk: fewer chunks = fewer passes over the fp32 [V, H] dW accumulator (8 V H bytes
# each); chosen from bench/RESULTS.md section 1.
FAST_CHUNK_ROWS = 3072
FAST_CHUNK_MAX_BYTES = 6 * 1024 * 1024 * 1024  # fp32 logits of one chunk (dz is written over them), at most
MAX_SLAB = 8192  # widest vocabulary slab of the lean tiles (the per-row path's dW slab: twice that)
FP16_DZ_SCALE = 2.0**15  # |dz| <= 1, so dz * 2^15 <= 32768 < 65504


def default_chunk(v: int) -> int:
    """Rows per chunk of the fast and per-row paths: ``FAST_CHUNK_ROWS``, fewer (a multiple of 16, at least 16) where
    a chunk's fp32 logits would exceed ``FAST_CHUNK_MAX_BYTES``."""
    return max(16, min(FAST_CHUNK_ROWS, FAST_CHUNK_MAX_BYTES // (4 * v) // 16 * 16))


# --------------------------------------------------------------------------- matmul helpers
def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with fp32 output (cuBLAS low-precision operands, fp32 accumulation and output)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(*to_fp32(a, b), out=out)  # CPU has no mixed-dtype mm


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(*to_fp32(a, b))


def dz_scale(dtype: torch.dtype) -> float:
    return FP16_DZ_SCALE if dtype == torch.float16 else 1.0


# --------------------------------------------------------------------------- shared pieces
def gather(hidden: torch.Tensor, idx: torch.Tensor, all_valid: bool, rows: slice, whole: bool) -> torch.Tensor:
    if all_valid:
        return hidden if whole else hidden[rows]
    return hidden.index_select(0, idx[rows])


def finish(m, s, tgt, zsum, eps: float, v: int):
    """(lse, per-row loss, 1/s) from the row max ``m``, sum exp(z - m) ``s``, target logit and sum of
    logits. loss = lse - (1 - eps) z_y - eps * mean(z) (PyTorch's label smoothing), computed as
    ``(m - z_y) + log s`` so a large ``lse`` adds no rounding."""
    log_s = torch.log(s)
    if eps == 0.0:
        loss = (m - tgt) + log_s
    else:
        loss = (1.0 - eps) * (m - tgt) + eps * (m - zsum / v) + log_s
    return m + log_s, loss, 1.0 / s


def target_coef(t, softcap, eps, out_scale):
    """d(loss_i)/d(z_i,y) without the softmax part, times out_scale: -(1 - eps) [* (1 - th_y^2)]."""
    a = torch.full_like(t, -(1.0 - eps) * out_scale)
    if softcap is not None:
        a = a * (1.0 - (t / softcap) ** 2)
    return a


class Targets:
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
    def of(cls, scan: LabelScan, eps, needed) -> "Targets | None":
        """The target term's index when it will be added (some row labelled, :meth:`wanted`), else None."""
        return cls(scan) if scan.n_valid and cls.wanted(eps, needed) else None

    def coef(self, a, row_w=None) -> "Targets":
        """Set ``a_i`` (and the rows' factors for dW, ``row_w``)."""
        self.a = a.contiguous()
        self.coef_w = (a if row_w is None else a * row_w).index_select(0, self.perm).contiguous()
        return self

    def add_dh(self, dh_acc, weight):
        n = dh_acc.shape[0]
        ar = torch.arange(n + 1, device=dh_acc.device)
        tk.rows_axpy(dh_acc, ar[:n], weight, self.y, self.a, ar)

    def slab_bounds(self, v, v_s):
        edges = torch.arange(0, v + v_s, v_s, device=self.labels.device)
        return torch.searchsorted(self.labels, edges).tolist()

    def add_dw(self, dw_acc, hidden, lo, hi, s0):
        tk.rows_axpy(dw_acc, self.labels[lo:hi] - s0, hidden, self.src_rows, self.coef_w, self.starts[lo : hi + 1])


def outputs(loss_rows, lse, idx, n, all_valid, reduction):
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


def forward_outputs(ctx, loss_rows, lse, idx, n, all_valid, reduction):
    """What each path's autograd forward returns: :func:`outputs`, the lse marked non-differentiable, and no
    materialised zero gradients for outputs that get none."""
    ctx.set_materialize_grads(False)
    loss, lse_full = outputs(loss_rows, lse, idx, n, all_valid, reduction)
    ctx.mark_non_differentiable(lse_full)
    return loss, lse_full


def scaled_rows(raw, scale, idx, all_valid, n, dtype):
    """dh [N, H] in ``dtype``: the valid rows' fp32 ``raw`` times ``scale`` (0-d or per row), rounded once; 0 on
    ignored rows."""
    dh = (torch.empty if all_valid else torch.zeros)(n, raw.shape[1], device=raw.device, dtype=dtype)
    return tk.scale_cast(raw, scale, dh, None if all_valid else idx)


def row_coefficients(grad_loss, idx, all_valid, reduction, n_valid):
    """fp32 grad_output per valid row: a 0-d tensor when uniform, else [N_v]."""
    g = grad_loss.float()
    if reduction != "none":
        return g / max(n_valid, 1) if reduction == "mean" else g
    c = g if all_valid else g.index_select(0, idx)
    if bool((c == c[0]).all()):
        return c[0]
    return c


def full_weight(weight: torch.Tensor, frozen: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(the weight the logits use, the first of its columns that gets a gradient): ``[frozen, weight]`` side by side
    when a frozen part is given (a LoRA head's base weight beside lora_B: only ``weight``'s columns are
    differentiated, ``2 N_v H_t V`` flops for dW instead of ``2 N_v H V``)."""
    if frozen is None:
        return weight, 0
    return torch.cat([frozen, weight], dim=1), frozen.shape[1]


def dw_row_factors(c: torch.Tensor, out_scale: float):
    """(factors of h's rows before their one rounding, factor after the dW GEMM) for grad_output coefficients ``c``:
    ``(None, c / out_scale)`` when uniform (0-d); per row ``c / 2^k`` (|.| <= 1) and ``2^k / out_scale``."""
    if c.dim() == 0:
        return None, c / out_scale
    pow2 = torch.ldexp(torch.ones((), device=c.device), torch.frexp(c.abs().max())[1])
    return c / pow2, pow2 / out_scale
