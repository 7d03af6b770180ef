"""Label smoothing. Left to itself the Trainer pops the labels when ``label_smoothing_factor > 0`` (the fused path is
then bypassed, said once); the plugin's Trainer patch keeps them with an engaged causal LM and the fused path
computes transformers' ``LabelSmoother`` exactly (loss and gradients)."""

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


def test_trainer_hands_label_smoothing_to_the_kernel(tmp_path, capsys):
    """`label_smoothing_factor` through the HF Trainer (what LLaMA-Factory's SFT trainers are): the plugin's Trainer
    patch keeps the labels with the engaged model and the kernel smooths; loss and gradients equal the Trainer's
    own LabelSmoother on the unfused model."""
    from transformers import Trainer, TrainingArguments

    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp.integration import trainer as trainer_patch

    ref, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    trainer_patch.patch_label_smoothing()
    try:
        args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to="none", use_cpu=True)
        plain, fused = Trainer(model=ref, args=args), Trainer(model=cand, args=args)
        assert plain.label_smoother is not None and fused.label_smoother is None
        batch = make_batch(ignore_frac=0.3)
        want, got = plain.compute_loss(ref, dict(batch)), fused.compute_loss(cand, dict(batch))
        assert abs(got.item() - want.item()) <= 1e-5 * want.item()
        want.backward(), got.backward()
        for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
            if p.requires_grad:
                assert rel(q.grad, p.grad) <= 1e-5, n
        err = capsys.readouterr().err
        assert "[liger_fsdp] label_smoothing_factor 0.1: the fused kernel computes the smoothed loss" in err
        assert NO_LABELS not in err
    finally:
        import transformers.trainer

        _patch.undo(transformers.trainer.Trainer, "__init__")
