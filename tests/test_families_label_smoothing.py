"""Label smoothing (issue 12 item 3). The Trainer pops the labels when ``label_smoothing_factor > 0``, so the
fused path is bypassed, said once. The fused path itself computes transformers' ``LabelSmoother`` exactly
(loss and gradients) when its state asks for it, ready for a caller that keeps the labels."""

import torch
from transformers.trainer_pt_utils import LabelSmoother

from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.forward import NO_LABELS
from llamafactory_liger_fsdp.testing import make_batch, rel, twin


def test_bypass_said_once(capsys):
    ref, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    batch = make_batch()
    labels = batch.pop("labels")
    for _ in range(2):
        out = cand(**batch)  # what the Trainer calls with label smoothing on: no labels
        assert out.logits is not None
    smoothed = LabelSmoother(epsilon=0.1)(out, labels, shift_labels=True)
    assert abs(smoothed.item() - LabelSmoother(epsilon=0.1)(ref(**batch), labels, shift_labels=True).item()) < 1e-6
    assert capsys.readouterr().err.count(NO_LABELS) == 1


def test_fused_label_smoothing_is_the_trainers():
    ref, cand = twin("qwen2", "lora")
    engage(cand, backend="torch")
    cand.base_model.model.forward.liger_fsdp_state.label_smoothing = 0.1
    batch = make_batch(ignore_frac=0.4)
    labels = batch.pop("labels")
    want = LabelSmoother(epsilon=0.1)(ref(**batch), labels, shift_labels=True)
    got = cand(**batch, labels=labels, num_items_in_batch=torch.tensor(3)).loss  # the smoother ignores num_items
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    want.backward(), got.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
        if p.requires_grad:
            assert rel(q.grad, p.grad) <= 1e-5, n
