"""v1's DPO trainer (git main) with the plugin, in process: the loss, every logged metric and every trainable gradient
equal LLaMA-Factory's own methods on the unfused twin (fp32, 1e-5) for each ``pref_loss``, LD-DPO, ``pref_ftx``,
LoRA as the reference and a deep-copied full fine-tuning reference (engaged on its own, not running the policy)."""

from __future__ import annotations

import copy

import pytest
import torch

dpo = pytest.importorskip("llamafactory.v1.trainers.dpo_trainer")
if not hasattr(dpo, "DPOTrainer"):  # 0.9.5 ships an empty module (its launcher says DPO is not implemented)
    pytest.skip("this LLaMA-Factory's v1 has no DPO trainer", allow_module_level=True)

from llamafactory_liger_fsdp import engage, forward  # noqa: E402
from llamafactory_liger_fsdp.testing import VOCAB, make_model, make_peft, rel  # noqa: E402
from test_v1 import apply_kernel, assert_same_grads, fresh_run  # noqa: E402,F401


def pair_batch(seed: int = 0) -> dict:
    """Two rows of [chosen prompt | chosen answer | rejected prompt | rejected answer | padding], v1's format."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    types = torch.zeros(2, 24, dtype=torch.long)
    types[:, :10], types[:, 10:22] = 1, 2
    types[1, 20:] = 0  # a shorter rejected answer
    labels = ids.clone()
    for start, end in ((0, 4), (10, 14)):
        labels[:, start:end] = -100
    labels[types == 0] = -100
    return {"input_ids": ids, "labels": labels, "token_type_ids": types}


def stand_in(model, pref_loss="sigmoid", **kw):
    trainer = dpo.DPOTrainer.__new__(dpo.DPOTrainer)  # the methods under test, without v1's whole set-up
    trainer.model, trainer.ref_model, trainer.device, trainer.global_step = model, None, torch.device("cpu"), 1
    trainer.pref_loss, trainer.pref_beta, trainer.pref_ftx = pref_loss, kw.get("beta", 0.1), kw.get("ftx", 0.0)
    trainer.simpo_gamma, trainer.ld_alpha = kw.get("gamma", 0.5), kw.get("ld_alpha")
    trainer.dpo_label_smoothing = kw.get("smoothing", 0.0)
    if pref_loss == "sigmoid":
        trainer._init_ref_model()
    return trainer


@pytest.mark.parametrize("head, pref_loss, kw", [
    ("mts", "sigmoid", {}), ("mts", "sigmoid", {"ld_alpha": 0.5, "ftx": 0.3, "smoothing": 0.1}),
    ("lora", "orpo", {}), ("mts", "simpo", {"ftx": 0.2}), ("full", "sigmoid", {}), ("full", "simpo", {}),
])
def test_dpo_equals_v1s_own(head, pref_loss, kw):
    ref = make_peft(make_model("llama"), head)
    cand = copy.deepcopy(ref)
    apply_kernel(cand)
    try:
        for model in (ref, cand):
            model.train()
        trainers = [stand_in(m, pref_loss, **kw) for m in (ref, cand)]
        if head == "full" and pref_loss == "sigmoid":  # the deep copy runs itself, engaged on its own
            copy_lm = engage.causal_lm_of(trainers[1].ref_model)
            assert engage.engaged(copy_lm) is not None and engage.engaged(copy_lm) is not engage.engaged(cand)
            assert copy_lm.__dict__["forward"] is not engage.causal_lm_of(cand).__dict__["forward"]
        batch = pair_batch()
        losses = [t.compute_loss(batch) for t in trainers]
        for loss in losses:
            loss.backward()
        assert rel(losses[1], losses[0]) < 1e-5
        assert forward.state_of(engage.causal_lm_of(cand)).steps == 1  # the fused forward answered (line said once)
        for key, value in trainers[0]._step_metrics.items():
            assert abs(trainers[1]._step_metrics[key] - value) <= 1e-5 * max(1.0, abs(value)), key
        assert_same_grads(cand, ref)
    finally:
        engage.disengage(cand)


def test_guard_holds_compute_loss_against_llamafactorys(caplog, monkeypatch):
    """Step 1 runs LLaMA-Factory's own compute_loss (its own _compute_ref_logps, the model's own forward) beside the
    replacement on a slice: exact once on an honest run; a release whose loss differs (here: halved) stops the run
    naming the method and the LLaMA-Factory version."""
    import logging
    from importlib.metadata import version

    from llamafactory_liger_fsdp.config import LigerFsdpConfigError

    cand = make_peft(make_model("llama"), "mts")
    apply_kernel(cand)
    try:
        cand.train()
        trainer = stand_in(cand, "sigmoid")
        with caplog.at_level(logging.INFO):
            for seed in (0, 1):
                trainer.compute_loss(pair_batch(seed)).backward()
        lines = [r.getMessage() for r in caplog.records if "guard:" in r.getMessage()]
        assert len(lines) == 1 and "guard: step 1 exact: LLaMA-Factory's DPOTrainer.compute_loss" in lines[0], lines
    finally:
        engage.disengage(cand)
    released = dpo.DPOTrainer.compute_loss
    monkeypatch.setattr(dpo.DPOTrainer, "compute_loss", lambda self, batch: released(self, batch) / 2)
    cand = make_peft(make_model("llama"), "mts")
    apply_kernel(cand)  # patches the changed method
    try:
        cand.train()
        with pytest.raises(LigerFsdpConfigError) as exc:
            stand_in(cand, "sigmoid").compute_loss(pair_batch())
    finally:
        engage.disengage(cand)
    msg = str(exc.value)
    assert "replacement of LLaMA-Factory's DPOTrainer.compute_loss does not give what LLaMA-Factory's own gives" in msg
    assert f"llamafactory {version('llamafactory')}" in msg
