"""The guard never steps aside and checks what the trainer receives (in process, fast tier): a forward that calls its
head twice is checked and, under an untested transformers, stopped when the call changes the loss; a forward that
never calls its head as a module is compared in its own precision and the line says so; a batch too large to check
stops under untested versions and says so once otherwise; a 1% error after the kernel stops SFT (in the model
output) and v1 (in what ``forward.token_logps`` hands the trainer); a changed v1 ``compute_log_probs`` of
LLaMA-Factory stops the run. (DPO / KTO: tests/test_preference.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from llamafactory_liger_fsdp import families, guard_slice, versions
from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.testing import make_batch, make_inputs, twin
from support import names_key_and_fix

EXACT = "[liger_fsdp] guard: step 1 exact: model's own loss"
UNTESTED = ["transformers 5.99.0 (tested up to 5.8.0)"]


def _newer_forward(monkeypatch, cls, head):
    """What a transformers release could do: its own forward, computing the logits with ``head(self, h)``."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = head(self, h)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    monkeypatch.setattr(cls, "forward", forward)


def _llama(head_kind="full", dtype=torch.float32):
    _, cand = twin("llama", head_kind)
    return cand.to(dtype)


@pytest.mark.parametrize("untested", [False, True])
def test_a_second_head_call_that_changes_the_loss_stops_step_one(monkeypatch, untested):
    monkeypatch.setattr(versions, "untested", lambda *a, **k: UNTESTED if untested else [])
    cand = _llama()
    _newer_forward(monkeypatch, type(cand), lambda self, h: (self.lm_head(h) + self.lm_head(1.05 * h)) / 2)
    engage(cand, backend="torch")
    with pytest.raises(LigerFsdpConfigError) as exc:
        cand(**make_batch())
    msg = str(exc.value)
    assert "model's own loss" in msg and "fused loss" in msg
    if untested:
        assert "transformers 5.99.0" in msg
        names_key_and_fix(msg, "liger_fsdp_guard", "install the tested versions")


def test_a_harmless_second_head_call_is_checked_and_exact(monkeypatch, capsys):
    monkeypatch.setattr(versions, "untested", lambda *a, **k: UNTESTED)
    cand = _llama(dtype=torch.bfloat16)
    _newer_forward(monkeypatch, type(cand), lambda self, h: (self.lm_head(h) + self.lm_head(h)) / 2)
    engage(cand, backend="torch")
    cand(**make_batch())
    err = capsys.readouterr().err
    assert EXACT in err and "fp32 logits from the same bfloat16 inputs" in err and "not checked" not in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_never_called_as_a_module_is_compared_in_its_own_precision(monkeypatch, capsys, dtype):
    """No hook can reach the head: the model's own 16-bit logits against the fused loss, the looser bound said."""
    monkeypatch.setattr(versions, "untested", lambda *a, **k: UNTESTED)
    cand = _llama(dtype=dtype)
    linear = torch.nn.functional.linear
    _newer_forward(monkeypatch, type(cand), lambda self, h: linear(h, self.lm_head.weight))
    engage(cand, backend="torch")
    cand(**make_batch())
    err = capsys.readouterr().err
    assert EXACT in err and "logits of the model's own precision (its forward never calls the output embedding" in err
    _newer_forward(monkeypatch, type(cand), lambda self, h: 3 * linear(h, self.lm_head.weight))
    cand = _llama(dtype=dtype)
    engage(cand, backend="torch")
    with pytest.raises(LigerFsdpConfigError, match="model's own loss"):
        cand(**make_batch())


@pytest.mark.parametrize("name", ["qwen2_vl", "gemma3"])
def test_an_image_batch_too_large_to_run_whole_is_checked_on_a_window(monkeypatch, capsys, name):
    """Image inputs keep the batch whole; past the logits budget the model's own forward runs on the whole batch with
    its head input cut to the window (the fused side ignores the labels outside it): exact, and 1% off stops."""
    from llamafactory_liger_fsdp import losses

    monkeypatch.setattr(guard_slice, "LOGITS_BUDGET", 1024)
    _, cand = twin(name, "mts")
    engage(cand, backend="torch")
    cand(**make_inputs(name))
    err = capsys.readouterr().err
    assert EXACT in err and "(decoder on the whole micro-batch), positions" in err, err
    honest = losses.HeadLoss.loss
    monkeypatch.setattr(losses.HeadLoss, "loss", lambda self, *a, **k: honest(self, *a, **k) * 1.01)
    _, cand = twin(name, "mts")
    engage(cand, backend="torch")
    with pytest.raises(LigerFsdpConfigError, match="model's own loss"):
        cand(**make_inputs(name))


@pytest.mark.parametrize("untested", [False, True])
def test_a_batch_nothing_can_be_compared_on(monkeypatch, capsys, untested):
    """Images, past the budget, and label smoothing (no window for the smoother): nothing is compared -- said once with
    tested versions, a stop naming the cause, the versions and the fix with untested ones."""
    monkeypatch.setattr(versions, "untested", lambda *a, **k: UNTESTED if untested else [])
    monkeypatch.setattr(guard_slice, "LOGITS_BUDGET", 1024)
    _, cand = twin("qwen2_vl", "mts")
    engage(cand, backend="torch")
    cand.base_model.model.forward.liger_fsdp_state.label_smoothing = 0.1
    if untested:
        with pytest.raises(LigerFsdpConfigError) as exc:
            cand(**make_inputs("qwen2_vl"))
        msg = str(exc.value)
        assert "could not be compared" in msg and "image inputs" in msg and "transformers 5.99.0" in msg
        names_key_and_fix(msg, "liger_fsdp_guard", "install the tested versions", "liger_fsdp_guard: false")
    else:
        cand(**make_inputs("qwen2_vl"))
        cand(**make_inputs("qwen2_vl"))
        lines = [l for l in capsys.readouterr().err.splitlines() if "guard:" in l]
        assert len(lines) == 1 and "guard: step 1 not checked: a batch with image inputs" in lines[0], lines


def test_an_error_in_the_model_output_stops_sft(monkeypatch):
    """After the kernel and the loss seam: the family's output assembly (what the Trainer reads as ``.loss``)."""
    honest = families.build_output

    def off(family, causal_lm, loss, *a, **k):
        return honest(family, causal_lm, loss * 1.01, *a, **k)

    monkeypatch.setattr(families, "build_output", off)
    _, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    with pytest.raises(LigerFsdpConfigError, match="the fused loss is not the model's own"):
        cand(**make_batch())


@pytest.fixture
def v1_model():
    pytest.importorskip("llamafactory.v1")
    from llamafactory_liger_fsdp import engage as engage_mod
    from test_v1 import apply_kernel, build

    model = build("mts")
    apply_kernel(model)
    model.train()
    yield model
    engage_mod.disengage(model)


def test_v1_an_error_in_what_the_trainer_receives_stops(v1_model, monkeypatch):
    from llamafactory_liger_fsdp import forward
    from test_v1 import sft_loss, v1_batch

    honest = forward.token_logps
    monkeypatch.setattr(forward, "token_logps", lambda *a, **k: (lambda r: (r[0] * 1.01, *r[1:]))(honest(*a, **k)))
    with pytest.raises(LigerFsdpConfigError) as exc:
        sft_loss(v1_model, v1_batch())
    assert "LLaMA-Factory's BaseTrainer.compute_log_probs does not give what LLaMA-Factory's own gives" in str(exc.value)


def test_v1_a_changed_compute_log_probs_stops(v1_model, monkeypatch):
    """A release whose compute_log_probs differs from what the plugin answers (here: it scores labels * 1, but
    mean-normalises per row) is held against it, not silently replaced."""
    from llamafactory.v1.core import base_trainer

    from llamafactory_liger_fsdp import _patch
    from test_v1 import sft_loss, v1_batch

    cls = base_trainer.BaseTrainer
    patched = cls.compute_log_probs
    released = patched.__wrapped__

    def newer(self, model, batch):
        logps = released(self, model, batch)
        return logps / logps.shape[-1]

    _patch.undo(cls, "compute_log_probs")
    monkeypatch.setattr(cls, "compute_log_probs", newer)
    from llamafactory_liger_fsdp.integration.v1 import train as v1_train

    undo = v1_train.patch_compute_log_probs()
    try:
        with pytest.raises(LigerFsdpConfigError, match="BaseTrainer.compute_log_probs does not give"):
            sft_loss(v1_model, v1_batch())
    finally:
        for fn in undo:
            fn()
        monkeypatch.undo()
        v1_train.patch_compute_log_probs()


def test_the_kernels_label_smoothing_is_held_against_the_trainers(monkeypatch, capsys):
    """With ``label_smoothing_factor`` the kernel replaces transformers' ``LabelSmoother``: step 1 compares them too,
    and a smoother that changed (here: 1% larger) stops the run."""
    from transformers.trainer_pt_utils import LabelSmoother

    for broken in (False, True):
        if broken:
            honest = LabelSmoother.__call__
            monkeypatch.setattr(LabelSmoother, "__call__", lambda self, *a, **k: honest(self, *a, **k) * 1.01)
        _, cand = twin("qwen2", "lora")
        engage(cand, backend="torch")
        cand.base_model.model.forward.liger_fsdp_state.label_smoothing = 0.1
        if broken:
            with pytest.raises(LigerFsdpConfigError, match="model's own label-smoothed loss"):
                cand(**make_batch(ignore_frac=0.4))
        else:
            cand(**make_batch(ignore_frac=0.4))
            assert "[liger_fsdp] guard: step 1 exact: model's own" in capsys.readouterr().err


def test_a_text_rank_beside_a_rank_with_a_too_large_image_batch(monkeypatch, capsys):
    """Another rank's image batch is too large to run whole (the all-reduce says so): this rank's text batch is still
    cut and compared as usual, with the same number of forwards as the windowed rank."""
    from llamafactory_liger_fsdp import guard

    honest = guard.all_max
    monkeypatch.setattr(guard, "all_max", lambda values, group=None: [v if i != 2 else 1.0 for i, v in
                                                                       enumerate(honest(values, group))])
    _, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    cand(**make_batch())
    assert EXACT in capsys.readouterr().err
