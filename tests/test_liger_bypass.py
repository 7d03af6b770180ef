"""`enable_liger_kernel: true` beside `liger_fsdp: true`: Liger's fused loss is never called, the
loss stays exact (Liger's class-level forward is what LLaMA-Factory installs)."""

import pytest

liger = pytest.importorskip("liger_kernel")

from llamafactory_liger_fsdp.engage import engage  # noqa: E402
from llamafactory_liger_fsdp.testing import make_batch, rel, twin  # noqa: E402


def test_liger_flce_not_called(monkeypatch):
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from liger_kernel.ops import fused_linear_cross_entropy as liger_flce
    from transformers.models.llama import modeling_llama

    original_forward = modeling_llama.LlamaForCausalLM.forward
    try:
        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True)
        assert modeling_llama.LlamaForCausalLM.forward is not original_forward  # Liger's lce_forward is in place
        calls = []
        monkeypatch.setattr(
            liger_flce.LigerFusedLinearCrossEntropyFunction, "apply",
            staticmethod(lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(AssertionError("Liger FLCE called"))),
        )
        ref, cand = twin("llama", "mts")
        engage(cand, backend="torch")
        batch = make_batch()
        loss = cand(**batch).loss
        loss.backward()
        assert calls == []
        # reference: the unfused loss with the original (non-Liger) forward
        modeling_llama.LlamaForCausalLM.forward = original_forward
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
            if p.requires_grad:
                assert rel(q.grad, p.grad) <= 1e-5, n
    finally:
        modeling_llama.LlamaForCausalLM.forward = original_forward
