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


def _assert_smoothed_by_the_kernel(ref, cand, want, got, capsys):
    """The kernel's smoothed loss and every gradient equal the Trainer's own LabelSmoother on the unfused model."""
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    want.backward(), got.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
        if p.requires_grad:
            assert rel(q.grad, p.grad) <= 1e-5, n
    err = capsys.readouterr().err
    assert "[liger_fsdp] label_smoothing_factor 0.1: the fused kernel computes the smoothed loss" in err
    return err


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
        assert NO_LABELS not in _assert_smoothed_by_the_kernel(ref, cand, want, got, capsys)
    finally:
        import transformers.trainer

        _patch.undo(transformers.trainer.Trainer, "__init__")


def test_wrapped_trainer_init(tmp_path, capsys, monkeypatch):
    """Another package wrapped ``transformers.Trainer.__init__``. With ``functools.wraps`` the signature check sees
    through it and the kernel takes over label smoothing exactly as with the bare Trainer; a bare
    ``(*args, **kwargs)`` wrapper hides the parameters: the plugin does not stop the run, says so once (not as a
    version problem) and the Trainer smooths itself, same loss. And without label smoothing the plugin leaves
    ``Trainer.__init__`` alone (``engage_model``); with it, the patch is recorded on the model and ``disengage``
    restores the original."""
    import dataclasses
    import functools
    from types import SimpleNamespace

    import transformers.trainer
    from transformers import Trainer, TrainingArguments

    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp import engage as engage_module
    from llamafactory_liger_fsdp.config import LigerFsdpConfig
    from llamafactory_liger_fsdp.integration import llamafactory as lf_integration
    from llamafactory_liger_fsdp.integration import trainer as trainer_patch
    from llamafactory_liger_fsdp.testing import make_model, make_peft

    owner = transformers.trainer.Trainer
    original = owner.__init__
    assert not getattr(original, _patch.MARK, False)
    before = list(_patch._APPLIED)
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to="none", use_cpu=True)

    def losses(ref, cand):
        plain, other = Trainer(model=ref, args=args), Trainer(model=cand, args=args)
        batch = make_batch(ignore_frac=0.3)
        return plain, other, plain.compute_loss(ref, dict(batch)), other.compute_loss(cand, dict(batch))

    models = []

    def engaged_twin():
        ref, cand = twin("llama", "mts")
        models.append(cand)
        engage(cand, backend="torch")
        return ref, cand

    try:
        # (a) functools.wraps: seen through, the kernel smooths; loss and gradients are the Trainer's LabelSmoother's
        @functools.wraps(original)
        def wrapped_init(self, *a, **kw):
            return original(self, *a, **kw)

        monkeypatch.setattr(owner, "__init__", wrapped_init)
        ref, cand = engaged_twin()
        trainer_patch.patch_label_smoothing()
        assert getattr(owner.__init__, _patch.MARK, False) and owner.__init__.__wrapped__ is wrapped_init
        plain, fused, want, got = losses(ref, cand)
        assert plain.label_smoother is not None and fused.label_smoother is None
        _assert_smoothed_by_the_kernel(ref, cand, want, got, capsys)
        _patch.undo(owner, "__init__")
        assert owner.__init__ is wrapped_init

        # (b) a bare (*args, **kwargs) wrapper: not patched, one line that names the wrapper; the Trainer smooths
        def bare_init(self, *a, **kw):
            return original(self, *a, **kw)

        monkeypatch.setattr(owner, "__init__", bare_init)
        ref, cand = engaged_twin()
        assert trainer_patch.patch_label_smoothing() == []
        assert owner.__init__ is bare_init
        err = capsys.readouterr().err
        assert err.count("wrapped by another package") == 1, err
        assert "this version is not supported" not in err
        plain, other, want, got = losses(ref, cand)
        assert plain.label_smoother is not None and other.label_smoother is not None
        assert abs(got.item() - want.item()) <= 1e-5 * want.item()
        monkeypatch.undo()
        assert owner.__init__ is original

        # without label smoothing engage_model does not touch Trainer.__init__; with it, disengage restores it
        cfg = LigerFsdpConfig(enabled=True, backend="torch")
        finetuning = SimpleNamespace(stage="sft", finetuning_type="lora")
        model = make_peft(make_model("llama"), "mts")
        models.append(model)
        assert lf_integration.engage_model(model, cfg, finetuning) is not None
        assert not getattr(owner.__init__, _patch.MARK, False)
        assert owner.__init__ is original
        engage_module.disengage(model)
        assert lf_integration.engage_model(model, dataclasses.replace(cfg, label_smoothing=0.1), finetuning) is not None
        assert getattr(owner.__init__, _patch.MARK, False)
        engage_module.disengage(model)
        assert owner.__init__ is original
    finally:
        for model in models:
            engage_module.disengage(model)
        for patch in [p for p in _patch._APPLIED if p not in before][::-1]:
            _patch.undo(patch.owner, patch.name)
        monkeypatch.undo()
    assert transformers.trainer.Trainer.__init__ is original and _patch._APPLIED == before
