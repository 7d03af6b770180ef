"""The guard under sequence parallelism, in process (fast tier): its reference side is the model's own head on the very
hidden states the fused path used (exact in fp32; within the bf16 bound with a LoRA head and its dropout, where an
unsplit decoder would not be), a 1% error stops the run naming the run's real step, the stand-in logits make a
trainer's own loss see exactly the log-probs, collectives run on the process group's device (not a parameter's, not
the global rank's), and each run's CP state belongs to its model (a second run in one process is checked again)."""

from __future__ import annotations

import pytest
import torch

from llamafactory_liger_fsdp import engage, guard, guard_split
from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from llamafactory_liger_fsdp.losses import IGNORE_INDEX, shifted_labels
from llamafactory_liger_fsdp.testing import make_batch, twin


def _probed(name: str, head: str, dtype, dropout: float = 0.0):
    _, model = twin(name, head, dropout=dropout)
    model = model.to(dtype).train()
    engage.engage(model, backend="torch", any_head=True, request_only=True)
    batch = make_batch()
    targets = shifted_labels(batch["labels"], IGNORE_INDEX)
    probe = guard_split.Probe()
    guard_split._ACTIVE.append(probe)
    try:
        logps, sums, vocab = guard_split.token_logps(model, engage.causal_lm_of(model), {
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, targets, sums=True)
    finally:
        guard_split._ACTIVE.remove(probe)
    (record,) = probe.records
    return probe, record, logps, sums, vocab, targets


@pytest.mark.parametrize("name, head, dtype, dropout", [("llama", "full", torch.float32, 0.0),
                                                        ("llama", "lora", torch.bfloat16, 0.1),
                                                        ("gemma2", "full", torch.bfloat16, 0.0)])
def test_reference_is_the_models_own_head_on_the_same_hidden_states(name, head, dtype, dropout):
    """Gemma 2: its forward's final-logit softcap is the model's own; LoRA: its dropout masks replayed."""
    probe, record, logps, sums, vocab, _ = _probed(name, head, dtype, dropout)
    dtype_, own, _ = probe.precision(guard_split.Split("x", None, None))
    assert dtype_ == dtype and not own and torch.equal(record.ours, logps.detach().float())
    rtol, atol = guard.bounds(dtype)
    assert not guard.worst_element({"logps": (record.reference, logps)}, rtol, atol)[0]
    if dtype == torch.float32:  # in 16 bits the logits' sums are compared as the metrics take them (means)
        assert not guard.worst_element({"sums": (record.sums, sums)}, rtol, atol)[0]
    assert guard.worst_element({"logps": (record.reference, logps * 1.01)}, rtol, atol)[0]  # a 1% error is out


def test_two_columns_give_a_trainers_cross_entropy_exactly_the_log_probs():
    logps = torch.tensor([[0.0, -1e-9, -0.5, -7.0, -40.0, 1e-7]])
    means = torch.tensor([[3.0, -2.0, 0.5, 11.0, -9.0, 0.0]])
    labels = torch.tensor([[5, 2, IGNORE_INDEX, 1, 0, 7]])
    logits = guard_split.two_columns(logps, means)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 2), guard_split.class_zero(labels).view(-1),
                                           reduction="none").view_as(logps)
    scored = labels != IGNORE_INDEX
    assert torch.allclose(-ce[scored], logps.clamp(max=0)[scored], rtol=1e-6, atol=1e-6) and not ce[~scored].any()
    assert torch.allclose(logits.mean(-1), means, atol=1e-5)


def _split(ours_factor: float, step_seen: list):
    def run(probe):
        step_seen.append(True)
        value = torch.tensor(2.0)
        return value * ours_factor, {"loss": (value, value * ours_factor)}

    return guard_split.Split("LLaMA-Factory's sequence_parallel_loss", run, lambda: torch.tensor(2.0),
                             dtype=torch.float32, precision="test")


class _State:
    guard = True


@pytest.mark.parametrize("factor", [1.0, 1.01])
def test_first_call_decides_on_the_runs_step(factor, capsys):
    model, state, seen = torch.nn.Linear(2, 2).train(), _State(), []
    kwargs = dict(facts=lambda: dict(step=7, problem=None, labelled=True, where="the whole micro-batch"))
    if factor == 1.0:
        assert float(guard_split.first_call(state, _split(factor, seen), model, "llama", **kwargs)) == 2.0
        assert "[liger_fsdp] guard: step 7 exact: LLaMA-Factory's sequence_parallel_loss: loss 2" in \
            capsys.readouterr().err
    else:
        with pytest.raises(LigerFsdpConfigError) as err:
            guard_split.first_call(state, _split(factor, seen), model, "llama", **kwargs)
        assert "`liger_fsdp_guard`: on step 7 the plugin's replacement of LLaMA-Factory's sequence_parallel_loss" \
            in str(err.value) and "Fix:" in str(err.value)
    assert seen == [True] and not state.guard
    guard_split.first_call(state, _split(factor, seen), model, "llama", **kwargs)  # decided: not run again
    assert seen == [True]


def test_no_labels_anywhere_defers_and_a_data_error_stops():
    model, state, seen = torch.nn.Linear(2, 2).train(), _State(), []
    guard_split.first_call(state, _split(1.0, seen), model, "llama",
                           lambda: dict(step=1, problem=None, labelled=False, where=""))
    assert state.guard and not seen  # checked on a later call
    with pytest.raises(Exception, match="`resize_vocab`: step 2"):
        guard_split.first_call(state, _split(1.0, seen), model, "llama",
                               lambda: dict(step=2, problem="token id 9 in input_ids", labelled=True, where=""))


def test_collectives_run_on_the_groups_device(monkeypatch):
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert guard.collective_device() == torch.device("cpu")

    class Accelerator:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def current_accelerator():
            return torch.device("cuda")

        @staticmethod
        def current_device_index():
            return 3

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch, "accelerator", Accelerator)
    assert guard.collective_device() == torch.device("cuda", 3)  # the local device, whatever the parameters' is


def test_v1_loss_is_called_with_the_groups_device_not_the_global_rank(monkeypatch):
    pytest.importorskip("llamafactory.v1")
    from types import SimpleNamespace

    from llamafactory_liger_fsdp import collective
    from llamafactory_liger_fsdp.integration.v1 import ulysses

    sp = SimpleNamespace(dist=torch.distributed)
    monkeypatch.setattr(collective, "collective_device", lambda group=None: torch.device("cpu"))
    with ulysses.rank_as_device(sp):
        assert sp.dist.get_rank() == torch.device("cpu") and sp.dist.ReduceOp is torch.distributed.ReduceOp
    assert sp.dist is torch.distributed


def test_the_real_step_is_read_from_the_calling_trainer():
    pytest.importorskip("llamafactory.v1")
    from llamafactory.v1.core.base_trainer import BaseTrainer

    from llamafactory_liger_fsdp.integration.v1 import ulysses

    class Trainer(BaseTrainer):
        def compute_loss(self, batch):
            return ulysses.trainer_step()

    trainer = object.__new__(Trainer)
    trainer.global_step = 12
    assert trainer.compute_loss({}) == 12 and ulysses.trainer_step() is None


def test_each_runs_cp_state_belongs_to_its_model():
    """Two models take v1's sequence_parallel_loss (one run after another in a process): one shared slot replacement
    that dispatches by model; each model's seam (its guard state) its own; all undone when the last disengages."""
    pytest.importorskip("llamafactory.v1")
    import importlib

    from llamafactory_liger_fsdp.integration.v1 import cp_rm, ulysses

    sp = importlib.import_module(ulysses.SP_MODULE)
    mapping, key, _ = ulysses.slot(sp)
    original = mapping[key]
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    seams = [cp_rm.Seam(object, True), cp_rm.Seam(object, True)]
    for model, seam in zip((first, second), seams):
        engage.record_undo(model, ulysses.take(model, seam))
    try:
        assert mapping[key] is not original and ulysses.seam_of(first) is seams[0]
        assert ulysses.seam_of(second) is seams[1] and cp_rm.taken(second)
        seams[0].guard = False  # the first run checked its step
        assert seams[1].guard and not cp_rm.taken(torch.nn.Linear(2, 2))
        engage.disengage(first)
        assert ulysses.seam_of(first) is None and mapping[key] is not original
    finally:
        engage.disengage(first)
        engage.disengage(second)
    assert mapping[key] is original
