"""The kernel seam against a float64 reference: loss and both gradients, every backend that runs here.

The triton backend runs on the CPU under TRITON_INTERPRET=1 (set by tests/test_triton_interpret.py's
subprocess); this file tests the torch backend in-process."""

import pytest
import torch

from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy
from tiny import rel


def reference(h, w, y, ignore_index=-100, reduction="mean", softcap=None):
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = h64 @ w64.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = torch.nn.functional.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")
    n = (y != ignore_index).sum().clamp(min=1)
    if reduction == "mean":
        loss = loss / n
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def inputs(n, h, v, dtype, seed=0, ignore=0.25):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / h**0.25).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.25).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignore] = -100
    return hidden, weight, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("shape", [(37, 48, 101), (64, 32, 300), (5, 16, 7)])
def test_torch_fp32(shape, softcap, reduction):
    h, w, y = inputs(*shape, torch.float32)
    loss = fused_linear_cross_entropy(h, w, y, reduction=reduction, softcap=softcap, backend="torch")
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(h, w, y, reduction=reduction, softcap=softcap)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert rel(h.grad, ref_dh) <= 1e-5 and rel(w.grad, ref_dw) <= 1e-5


def test_torch_chunking_is_exact():
    from llamafactory_liger_fsdp.ops.torch_flce import fused_linear_cross_entropy_torch

    h, w, y = inputs(50, 16, 40, torch.float32)
    a = fused_linear_cross_entropy_torch(h, w, y, chunk_rows=7)
    ga = torch.autograd.grad(a, (h, w))
    b = fused_linear_cross_entropy_torch(h, w, y, chunk_rows=1000)
    gb = torch.autograd.grad(b, (h, w))
    assert abs(a.item() - b.item()) <= 1e-6 * b.item()
    assert rel(ga[0], gb[0]) <= 1e-6 and rel(ga[1], gb[1]) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_low_precision(dtype):
    h, w, y = inputs(64, 64, 257, dtype)
    loss = fused_linear_cross_entropy(h, w, y, backend="torch")
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(h, w, y)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * ref_loss.item()
    assert rel(h.grad, ref_dh) <= 1e-2 and rel(w.grad, ref_dw) <= 1e-2


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_is_finite_and_zero_grad(reduction):
    h, w, y = inputs(9, 8, 11, torch.float32)
    y[:] = -100
    loss = fused_linear_cross_entropy(h, w, y, reduction=reduction, backend="torch")
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_only_needed_grads():
    h, w, y = inputs(9, 8, 11, torch.float32)
    w.requires_grad_(False)
    fused_linear_cross_entropy(h, w, y, backend="torch").backward()
    assert h.grad is not None and w.grad is None


def test_shape_and_dtype_errors():
    h, w, y = inputs(9, 8, 11, torch.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        fused_linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(TypeError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        fused_linear_cross_entropy(h, w.bfloat16(), y)
    with pytest.raises(ValueError, match="reduction must be one of"):
        fused_linear_cross_entropy(h, w, y, reduction="none")


def test_autocast_casts_like_linear():
    h, w, y = inputs(16, 16, 33, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, y, backend="torch")
        z = torch.nn.functional.linear(h, w)
    ref = torch.nn.functional.cross_entropy(z.float(), y)
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
