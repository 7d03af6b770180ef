"""The real Triton kernel (CPU, TRITON_INTERPRET=1 from conftest) against a float64 reference:
shapes that are no multiple of any tile, softcap, both reductions, every loop path of the tiling,
fp32/bf16/fp16 inputs, all-ignored batches, determinism."""

import pytest
import torch

from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy
from llamafactory_liger_fsdp.ops.triton_flce import fused_linear_cross_entropy_triton, plan_tiles
from test_ops import inputs, reference
from tiny import rel

TILES = [None, (7, 16, 5), (64, 64, 9), (3, 1000, 100)]  # None: planned; others reach R<N_v / many slabs


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_exact(tiles, softcap, reduction, fast):
    h, w, y = inputs(53, 24, 203, torch.float32, seed=3)
    loss = fused_linear_cross_entropy_triton(h, w, y, reduction=reduction, softcap=softcap, tiles=tiles, fast=fast)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(h, w, y, reduction=reduction, softcap=softcap)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert rel(h.grad, ref_dh) <= 1e-5 and rel(w.grad, ref_dw) <= 1e-5


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(96, 64, 1000), (61, 40, 509)])
def test_low_precision(dtype, shape, backend):
    h, w, y = inputs(*shape, dtype, seed=5)
    loss = fused_linear_cross_entropy(h, w, y, backend=backend)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(h, w, y)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()  # fp32 logits and accumulation
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-3
    assert rel(h.grad, ref_dh) <= tol and rel(w.grad, ref_dw) <= tol


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored(reduction, backend):
    h, w, y = inputs(9, 8, 11, torch.float32)
    y[:] = -100
    loss = fused_linear_cross_entropy(h, w, y, reduction=reduction, backend=backend)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_no_ignored_and_single_row():
    for n in (1, 17):
        h, w, y = inputs(n, 16, 33, torch.float32, ignore=0.0)
        y[y < 0] = 0
        loss = fused_linear_cross_entropy(h, w, y, backend="triton")
        loss.backward()
        ref_loss, ref_dh, ref_dw = reference(h, w, y)
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        assert rel(h.grad, ref_dh) <= 1e-5 and rel(w.grad, ref_dw) <= 1e-5


def test_deterministic():
    outs = []
    for _ in range(2):
        h, w, y = inputs(40, 32, 300, torch.bfloat16, seed=9)
        loss = fused_linear_cross_entropy_triton(h, w, y, tiles=(16, 64, 16))
        loss.backward()
        outs.append((loss.detach(), h.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_plan_respects_budget():
    # the real shapes of the benchmark, 25% ignored
    for n, h, v in [(8192, 4096, 128256), (16384, 4096, 128256), (16384, 3584, 152064)]:
        nv = n * 3 // 4
        c, v_s, r = plan_tiles(nv, h, v, True, 224 << 20)
        assert 4 * c * v <= 224 << 20
        assert v_s >= 2048 and r >= 2048  # big enough GEMMs to stay on the matmul roof


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
def test_only_needed_grads_and_scaled_grad_out(backend):
    h, w, y = inputs(19, 8, 31, torch.float32)
    w.requires_grad_(False)
    (3.0 * fused_linear_cross_entropy(h, w, y, backend=backend)).backward()
    _, ref_dh, _ = reference(h, w, y)
    assert w.grad is None and rel(h.grad, 3.0 * ref_dh) <= 1e-5
