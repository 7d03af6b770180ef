"""The kernel seam's API on every backend against ``F.cross_entropy`` in float64: reductions
(mean/sum/none with any per-row grad_output), label smoothing, softcap, the per-row lse, ignored
rows, bad labels, shape/dtype errors, autocast. Triton runs under TRITON_INTERPRET=1 (conftest)."""

import functools

import pytest
import torch
from support.kernel import OpLog, inputs, reference, run

from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy
from llamafactory_liger_fsdp.testing import rel

BACKENDS = ["torch", "triton", "triton_fast"]


def _grad_rows(n, seed=0):
    """Per-row grad_output of every sign and size (preference losses weight rows arbitrarily)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, generator=g) * 3.0
    c[::7] = 0.0
    return c


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "reduction,label_smoothing,softcap",
    [("mean", 0.0, None), ("sum", 0.1, None), ("none", 0.0, None), ("none", 0.2, 2.5), ("mean", 0.3, 2.5)],
)
def test_api_fp32_against_float64(backend, reduction, label_smoothing, softcap):
    h, w, y = inputs(37, 24, 101, torch.float32, seed=1)
    g = _grad_rows(37) if reduction == "none" else None
    loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, grad_rows=g, reduction=reduction,
                       label_smoothing=label_smoothing, softcap=softcap, backend=backend)
    ref_loss, ref_dh, ref_dw = reference(h, w, y, reduction=reduction, softcap=softcap,
                                         label_smoothing=label_smoothing, grad_rows=g)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert rel(loss, ref_loss) <= 1e-6
    if reduction == "none":
        assert torch.all(loss[y == -100] == 0)
    assert rel(dh, ref_dh) <= 1e-5 and rel(dw, ref_dw) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction,label_smoothing,softcap", [("mean", 0.0, None), ("sum", 0.1, None), ("none", 0.1, 2.5)])
def test_frozen_weight_columns(backend, reduction, label_smoothing, softcap):
    """``frozen_weight`` beside ``weight`` (a LoRA head's base weight beside lora_B): the loss and dh of the
    side-by-side weight, a gradient for ``weight``'s columns only; fp32 against float64."""
    h, w_all, y = inputs(37, 24, 101, torch.float32, seed=4)
    frozen, w = w_all.detach()[:, :20].contiguous(), w_all.detach()[:, 20:].clone().requires_grad_()
    g = _grad_rows(37) if reduction == "none" else None
    fn = functools.partial(fused_linear_cross_entropy, frozen_weight=frozen)
    loss, dh, dw = run(fn, h, w, y, grad_rows=g, reduction=reduction, label_smoothing=label_smoothing,
                       softcap=softcap, backend=backend)
    ref_loss, ref_dh, ref_dw = reference(h, w_all, y, reduction=reduction, softcap=softcap,
                                         label_smoothing=label_smoothing, grad_rows=g)
    assert dw.shape == w.shape and frozen.grad is None
    assert rel(loss, ref_loss) <= 1e-6 and rel(dh, ref_dh) <= 1e-5 and rel(dw, ref_dw[:, 20:]) <= 1e-5
    with torch.no_grad():  # the forward-only path
        assert rel(fn(h, w, y, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
                      backend=backend), ref_loss) <= 1e-6
    with pytest.raises(ValueError, match=r"frozen_weight \(101, 19\)"):
        fused_linear_cross_entropy(h, w, y, frozen_weight=frozen[:, 1:], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_other_than_default(backend):
    h, w, y = inputs(20, 16, 50, torch.float32, seed=2)
    y[y == -100] = 7  # 7 is a real class id here, and also the ignore index
    loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, ignore_index=7, label_smoothing=0.1, backend=backend)
    ref_loss, ref_dh, ref_dw = reference(h, w, y, ignore_index=7, label_smoothing=0.1)
    assert rel(loss, ref_loss) <= 1e-6 and rel(dh, ref_dh) <= 1e-5 and rel(dw, ref_dw) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_return_lse(backend, softcap):
    h, w, y = inputs(30, 16, 70, torch.float32, seed=4)
    loss, lse = fused_linear_cross_entropy(h, w, y, reduction="none", softcap=softcap, return_lse=True,
                                           backend=backend)
    z = h.detach().double() @ w.detach().double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = torch.where(y != -100, torch.logsumexp(z, dim=1), 0.0)
    assert lse.dtype == torch.float32 and lse.shape == (30,) and not lse.requires_grad and loss.shape == (30,)
    assert torch.all(lse[y == -100] == 0) and rel(lse, ref) <= 1e-6
    scalar = fused_linear_cross_entropy(h, w, y, backend=backend)  # default: a scalar, no lse
    assert scalar.dim() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_is_finite_and_zero_grad(backend, reduction):
    h, w, y = inputs(9, 8, 11, torch.float32)
    y[:] = -100
    loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, reduction=reduction, label_smoothing=0.1,
                       backend=backend)
    assert torch.all(loss == 0) and torch.all(dh == 0) and torch.all(dw == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, 2.0)])
def test_nothing_labelled_divided_by_zero_items(backend, smoothing, softcap):
    """The Trainer's loss for a step without a labelled token: ``sum / num_items_in_batch`` with 0 items. The
    unfused loss is NaN there and its gradients are exactly zero; so must the kernel's be (it got NaN before)."""
    h, w, y = inputs(9, 8, 11, torch.float32)
    y[:] = -100
    def unfused(h, w, y, label_smoothing, softcap):
        z = (h @ w.t()).float()
        z = softcap * torch.tanh(z / softcap) if softcap else z
        return torch.nn.functional.cross_entropy(z, y, reduction="sum", label_smoothing=label_smoothing)

    fused = functools.partial(fused_linear_cross_entropy, reduction="sum", backend=backend)
    for fn in (fused, unfused):
        loss, dh, dw = run(lambda *a, **k: fn(*a, **k) / torch.tensor(0), h, w, y, label_smoothing=smoothing,
                           softcap=softcap)
        assert torch.isnan(loss)  # 0 / 0, as in the model's own loss
        assert torch.equal(dh, torch.zeros_like(h)) and torch.equal(dw, torch.zeros_like(w)), fn


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_rows_grad_output_never_enters(backend):
    """Per-row losses (preference stages): an ignored row's grad_output may be inf or NaN (a mean over an empty
    answer); the gradients equal those with a zero there."""
    h, w, y = inputs(12, 8, 11, torch.float32, seed=3)
    g = _grad_rows(12)
    g[y == -100] = float("inf")
    g[torch.nonzero(y == -100)[0]] = float("nan")
    _, dh, dw = run(fused_linear_cross_entropy, h, w, y, grad_rows=g, reduction="none", backend=backend)
    _, ref_dh, ref_dw = reference(h, w, y, reduction="none", grad_rows=torch.where(y == -100, 0.0, g))
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert rel(dh, ref_dh) <= 1e-5 and rel(dw, ref_dw) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [11, 12, -1, -101, 10**9])
def test_bad_label_raises_before_any_kernel(backend, bad):
    h, w, y = inputs(9, 8, 11, torch.float32)
    y[3] = bad
    y[5] = bad
    with OpLog() as log, pytest.raises(ValueError) as err:
        fused_linear_cross_entropy(h, w, y, backend=backend)
    msg = str(err.value)
    assert f"label {bad} " in msg and "V=11" in msg and "2 such label" in msg
    assert not any(name in ("aten.mm", "aten.addmm", "aten.gather", "aten.index_select") for name in log.names)


def test_other_negative_ignore_index():
    h, w, y = inputs(9, 8, 11, torch.float32)
    y[y == -100] = -1
    loss = fused_linear_cross_entropy(h, w, y, ignore_index=-1, backend="torch")  # -1 ignored, no error
    assert rel(loss, reference(h, w, y, ignore_index=-1)[0]) <= 1e-6


def test_torch_chunking_is_exact():
    from llamafactory_liger_fsdp.ops.torch_flce import fused_linear_cross_entropy_torch

    h, w, y = inputs(50, 16, 40, torch.float32)
    a = fused_linear_cross_entropy_torch(h, w, y, chunk_rows=7, label_smoothing=0.1)
    ga = torch.autograd.grad(a, (h, w))
    b = fused_linear_cross_entropy_torch(h, w, y, chunk_rows=1000, label_smoothing=0.1)
    gb = torch.autograd.grad(b, (h, w))
    assert abs(a.item() - b.item()) <= 1e-6 * b.item()
    assert rel(ga[0], gb[0]) <= 1e-6 and rel(ga[1], gb[1]) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_low_precision(dtype):
    h, w, y = inputs(64, 64, 257, dtype)
    loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, backend="torch")
    ref_loss, ref_dh, ref_dw = reference(h, w, y)
    assert dh.dtype == dtype and dw.dtype == dtype
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * ref_loss.item()
    assert rel(dh, ref_dh) <= 1e-2 and rel(dw, ref_dw) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_needed_grads(backend):
    h, w, y = inputs(9, 8, 11, torch.float32)
    w.requires_grad_(False)
    fused_linear_cross_entropy(h, w, y, backend=backend).backward()
    assert h.grad is not None and w.grad is None


def test_argument_errors():
    h, w, y = inputs(9, 8, 11, torch.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        fused_linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(TypeError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        fused_linear_cross_entropy(h, w.bfloat16(), y)
    with pytest.raises(ValueError, match="reduction must be one of"):
        fused_linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        fused_linear_cross_entropy(h, w, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="labels must be integers"):
        fused_linear_cross_entropy(h, w, y.float())
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_linear_cross_entropy(h, w, y, backend="cuda")


def test_autocast_casts_like_linear():
    h, w, y = inputs(16, 16, 33, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, y, backend="torch")
    z = h.detach().bfloat16().double() @ w.detach().bfloat16().double().t()  # the operands nn.Linear would get
    ref = torch.nn.functional.cross_entropy(z, y)  # the kernel's logits are fp32 from them
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
