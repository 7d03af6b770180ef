"""The fused logits + statistics kernel (``ops.triton_logits``, Hopper-only on the GPU) run under the CPU interpreter
with ``FORCE``: its logits and combined statistics against cuBLAS-equivalent fp32 logits and the statistics pass, and
the fast path through it (mean / sum / none, softcap, label smoothing, a frozen LoRA base) against float64 at the
bf16 / fp16 rounding floor."""

import pytest
import torch
from support.kernel import inputs, plain_torch, reference, rel, run

from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy, triton_flce, triton_logits

SMALL = (32, 64, 32, 1, 1, 2)  # several row, column and K tiles on the small shapes, and GROUP_M edges


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(triton_logits, "FORCE", True)
    calls = []
    real = triton_logits.logits_and_parts

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(triton_logits, "logits_and_parts", counted)
    return calls


@pytest.mark.parametrize("config", [SMALL, triton_logits.CONFIG])
@pytest.mark.parametrize("softcap,eps", [(None, 0.0), (2.5, 0.1), (None, 0.2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_and_statistics_match_the_pass(monkeypatch, forced, config, softcap, eps, dtype):
    """z equals the fp32 GEMM of the 16-bit operands; max / sum-exp / target / sum of logits equal the statistics
    pass's over that z (V = 1000: a ragged last column tile; 45 rows: a ragged last row tile; labels in every tile)."""
    monkeypatch.setattr(triton_logits, "CONFIG", config)
    h, w, _ = inputs(45, 96, 1000, dtype, seed=4)
    h, w = h.detach(), w.detach()
    y = torch.randint(0, 1000, (45,), generator=torch.Generator().manual_seed(2))
    y[:4] = torch.tensor([0, 255, 256, 999])
    z = torch.empty(45, 1000)
    got_z, got = triton_flce._logits_stats(h, w, z, y, softcap, eps)
    assert forced and got_z.data_ptr() == z.data_ptr()
    ref_z = h.float() @ w.float().t()
    assert rel(got_z, ref_z) <= 1e-6
    want = triton_flce._chunk_stats(ref_z, y, softcap, eps)
    for g, r in zip(got, want):
        if r is None:
            assert g is None
        else:
            assert rel(g, r) <= 1e-6, (g, r)


def test_used_only_where_it_runs(monkeypatch):
    """Without FORCE: never on the CPU; never for fp32 or unaligned rows (V % 4, H % 8), which keep cuBLAS + the
    pass; and a compile failure is remembered and logged once."""
    h, w, _ = inputs(16, 64, 1000, torch.bfloat16)
    z = torch.empty(16, 1000)
    assert not triton_logits.usable(h.detach(), w.detach(), z)
    monkeypatch.setattr(triton_logits, "FORCE", True)
    assert triton_logits.usable(h.detach(), w.detach(), z)
    assert not triton_logits.usable(h.detach().float(), w.detach().float(), z)
    h2, w2, _ = inputs(16, 60, 1000, torch.bfloat16)  # 120-byte rows
    assert not triton_logits.usable(h2.detach(), w2.detach(), z)
    assert not triton_logits.usable(h.detach(), w.detach()[:999], torch.empty(16, 999))
    monkeypatch.setattr(triton_logits, "_failed", ["CompilationError: x"])
    assert not triton_logits.usable(h.detach(), w.detach(), z)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["mean", "sum", "none", "smooth", "softcap"])
def test_fast_path_through_it_at_the_rounding_floor(monkeypatch, forced, dtype, case):
    """triton_fast with the fused kernel: dX, dW within 5% of rounding the float64 gradient, loss at fp32."""
    monkeypatch.setattr(triton_logits, "CONFIG", SMALL)
    h, w, y = inputs(96, 64, 1000, dtype, seed=5)
    g = torch.rand(96, generator=torch.Generator().manual_seed(0)) * 3 + 0.1 if case == "none" else None
    kw = {"reduction": "mean" if case in ("smooth", "softcap") else case, "grad_rows": g,
          "label_smoothing": 0.1 if case == "smooth" else 0.0, "softcap": 3.0 if case == "softcap" else None}
    ref_loss, ref_dh, ref_dw = reference(h, w, y, **kw)
    loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, backend="triton_fast", **kw)
    assert forced, "the fused kernel did not run"
    assert rel(loss, ref_loss) <= 1e-6
    _, t_dh, t_dw = plain_torch(h, w, y, **kw)
    for ours, ref, plain in ((dh, ref_dh, t_dh), (dw, ref_dw, t_dw)):
        assert rel(ours, ref) <= 1.05 * rel(ref.to(dtype), ref) and rel(ours, ref) <= rel(plain, ref)


def test_frozen_lora_base_through_it(monkeypatch, forced):
    """A LoRA head ([W | B], W frozen) in bf16: the concatenated weight goes through the fused kernel; dB at the
    floor."""
    monkeypatch.setattr(triton_logits, "CONFIG", SMALL)
    h, w_all, y = inputs(80, 72, 1000, torch.bfloat16, seed=8)
    frozen, b = w_all.detach()[:, :64].contiguous(), w_all.detach()[:, 64:].clone().requires_grad_()
    _, ref_dh, ref_dw = reference(h, w_all, y)
    h.grad = None
    fused_linear_cross_entropy(h, b, y, backend="triton_fast", frozen_weight=frozen).backward()
    assert forced
    assert rel(h.grad, ref_dh) <= 1.05 * rel(ref_dh.bfloat16(), ref_dh)
    assert rel(b.grad, ref_dw[:, 64:]) <= 1.05 * rel(ref_dw[:, 64:].bfloat16(), ref_dw[:, 64:])
