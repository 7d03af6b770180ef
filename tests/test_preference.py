"""Preference stages in one process, through LLaMA-Factory's own trainers (CustomDPOTrainer, CustomKTOTrainer): the
loss, every logged metric and every trainable gradient with the flag equal those of LLaMA-Factory's own code on
the unfused model (fp32), for every `pref_loss`, KTO, both head kinds, LoRA as the reference model and a separate
`ref_model`; and the fused path never builds the [N, V] logits."""

import copy

import pytest
import torch

from llamafactory_liger_fsdp import config
from llamafactory_liger_fsdp.diagnostics import LiveBytes
from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.testing import VOCAB, make_model, make_peft, rel

TOL = 1e-5
ON = config.LigerFsdpConfig(enabled=True, backend="torch")


def _pairs(seed=0, pairs=2, seq=14):
    """Chosen rows then rejected rows, prompts masked, one answer shorter (LD-DPO's case)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2 * pairs, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, -4:] = -100
    labels[pairs, -2:] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.fixture(scope="module", autouse=True)
def patched_trainers():
    """What a DPO / KTO run's engage does (llamafactory.engage_model): patch that stage's trainer; undone after."""
    from llamafactory_liger_fsdp.integration import preference as integration

    undo = integration.patch_stage("dpo") + integration.patch_stage("kto")
    yield
    for fn in reversed(undo):
        fn()


def _trainer(cls, tmp_path, model, ref_model=None, **finetuning):
    from llamafactory.hparams import FinetuningArguments
    from transformers import Seq2SeqTrainingArguments

    ft = FinetuningArguments(pref_beta=0.1, **finetuning)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    return cls(model=model, ref_model=ref_model, finetuning_args=ft, processor=None, args=args, tokenizer=None)


def _compare(trainer, plain, fused, batch, train_eval=None, on=ON):
    kw = {} if train_eval is None else {"train_eval": train_eval}
    setattr(trainer.finetuning_args, config.ATTR, config.LigerFsdpConfig())
    loss_p, metrics_p = trainer.get_batch_loss_metrics(plain, dict(batch), **kw)
    setattr(trainer.finetuning_args, config.ATTR, on)
    loss_f, metrics_f = trainer.get_batch_loss_metrics(fused, dict(batch), **kw)
    assert abs(loss_f.item() - loss_p.item()) <= TOL * abs(loss_p.item()), (loss_f, loss_p)
    assert metrics_f.keys() == metrics_p.keys()
    # rewards and KL are beta x (policy - reference) log-probs: differences of large sums, so their rounding
    # is relative to beta x |log-probs|, not to the (small) difference itself
    logps = max(abs(v) for k, v in metrics_p.items() if k.split("/")[0].endswith("logps"))
    for key in metrics_p:
        floor = trainer.beta * logps if key.split("/")[0].endswith(("rewards", "kl")) else 1e-3
        assert abs(metrics_f[key] - metrics_p[key]) <= TOL * max(abs(metrics_p[key]), floor), (key, metrics_f, metrics_p)
    loss_p.backward(), loss_f.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        if p.requires_grad:
            assert p.grad is not None and rel(q.grad, p.grad) <= TOL, name
    return metrics_f


def _twins(kind, family="llama"):
    plain = make_peft(make_model(family), kind)
    fused = copy.deepcopy(plain)
    assert engage(fused, ON, any_head=True) is not None
    return plain, fused


@pytest.mark.parametrize("kind", ["mts", "lora"])
@pytest.mark.parametrize("pref_loss", ["sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"])
def test_dpo_losses_lora_as_reference(tmp_path, pref_loss, kind):
    from llamafactory.train.dpo.trainer import CustomDPOTrainer

    plain, fused = _twins(kind)
    trainer = _trainer(CustomDPOTrainer, tmp_path, plain, stage="dpo", pref_loss=pref_loss)
    metrics = _compare(trainer, plain, fused, _pairs())
    assert metrics["rewards/margins"] != 0.0  # the reference pass (adapters off) really differs from the policy


@pytest.mark.parametrize("kind", ["mts", "lora", "frozen"])
def test_dpo_through_triton_fast(tmp_path, kind, monkeypatch):
    """The per-token path of the real Triton kernel (interpreter; ops/triton_rows.py: the kept dz, or none for a
    frozen head) through the trainer: loss, metrics and gradients equal LLaMA-Factory's own code."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer

    from llamafactory_liger_fsdp.ops import triton_rows

    monkeypatch.setattr(triton_rows, "FAST_STORE_MAX_BYTES", 0 if kind == "frozen" else 1 << 30)
    calls = []
    real = triton_rows._StoredDzFLCE.apply
    monkeypatch.setattr(triton_rows._StoredDzFLCE, "apply", lambda *a: calls.append(a[1].requires_grad) or real(*a))
    if kind == "frozen":  # LoRA on the body only (PEFT re-enables the grads of an adapter frozen by hand)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        plain = get_peft_model(make_model("llama"), LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8,
                                                               init_lora_weights=False))
    else:
        plain = make_peft(make_model("llama"), kind)
    fused = copy.deepcopy(plain)
    on = config.LigerFsdpConfig(enabled=True, backend="triton_fast")
    assert engage(fused, on, any_head=True) is not None
    trainer = _trainer(CustomDPOTrainer, tmp_path, plain, stage="dpo", pref_loss="sigmoid")
    _compare(trainer, plain, fused, _pairs(seed=5), on=on)
    assert calls == [kind != "frozen"]  # the policy pass (the reference pass has no gradient: forward only)


@pytest.mark.parametrize("extra", [dict(pref_ftx=0.5), dict(ld_alpha=0.5), dict(dpo_label_smoothing=0.2)])
def test_dpo_options(tmp_path, extra):
    from llamafactory.train.dpo.trainer import CustomDPOTrainer

    plain, fused = _twins("mts")
    trainer = _trainer(CustomDPOTrainer, tmp_path, plain, stage="dpo", pref_loss="sigmoid", **extra)
    _compare(trainer, plain, fused, _pairs(seed=3))


def test_dpo_separate_reference_model_and_eval(tmp_path, capsys):
    """A separate ref_model (frozen, tied Qwen2 head) is engaged on first use and runs the forward-only path."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer

    plain, fused = _twins("lora", family="qwen2")
    ref = make_model("qwen2_tied", seed=5).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    trainer = _trainer(CustomDPOTrainer, tmp_path, plain, ref_model=ref, stage="dpo", pref_loss="sigmoid")
    _compare(trainer, plain, fused, _pairs(seed=7))
    assert "[liger_fsdp] reference model: head=frozen (tied) (lm_head)" in capsys.readouterr().err
    metrics = _compare(trainer, plain, fused, _pairs(seed=8), train_eval="eval")
    assert "eval_rewards/chosen" in metrics


@pytest.mark.parametrize("kind", ["mts", "lora"])
def test_kto(tmp_path, kind):
    from llamafactory.train.kto.trainer import CustomKTOTrainer

    plain, fused = _twins(kind)
    trainer = _trainer(CustomKTOTrainer, tmp_path, plain, stage="kto", pref_ftx=0.3)
    batch = _pairs(seed=11)
    kl = _pairs(seed=12)
    batch.update({f"kl_{k}": v for k, v in kl.items()}, kto_tags=torch.tensor([True, False, True, False]))
    metrics = _compare(trainer, plain, fused, batch)
    assert metrics["count/chosen"] == 2.0 and metrics["kl"] != 0.0


@pytest.mark.parametrize("stage,pref_loss", [("dpo", "sigmoid"), ("dpo", "hinge"), ("kto", None)])
def test_an_answer_with_no_labelled_token(tmp_path, stage, pref_loss):
    """Real data: a chosen answer cut to nothing (every label of that row ignored). The per-token path must give what
    LLaMA-Factory's own code gives on the unfused model -- a sequence log-prob of 0, finite, equal gradients -- never a
    NaN from the ignored rows' grad_output."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto.trainer import CustomKTOTrainer

    plain, fused = _twins("mts")
    batch = _pairs(seed=21)
    batch["labels"][0] = -100  # the first chosen answer: no labelled token
    if stage == "kto":
        trainer = _trainer(CustomKTOTrainer, tmp_path, plain, stage="kto")
        kl = _pairs(seed=22)
        kl["labels"][1] = -100
        batch.update({f"kl_{k}": v for k, v in kl.items()}, kto_tags=torch.tensor([True, False, True, False]))
    else:
        trainer = _trainer(CustomDPOTrainer, tmp_path, plain, stage="dpo", pref_loss=pref_loss)
    _compare(trainer, plain, fused, batch)
    assert all(torch.isfinite(p.grad).all() for p in fused.parameters() if p.grad is not None)


def test_no_logits_are_built():
    """After the forward (what stays alive until backward), the fused path holds the [N, V] logits less than
    LLaMA-Factory's ``model(...).logits.to(float32)`` (measured by allocation tracking; 90%: the fused path keeps a
    few small per-row tensors of its own)."""
    from llamafactory_liger_fsdp import engage, forward

    plain, fused = _twins("mts")
    batch = _pairs(pairs=4, seq=32)
    labels = batch.pop("labels")
    with LiveBytes() as fused_live:
        logps, sums, vocab_size = forward.token_logps(fused, engage.causal_lm_of(fused), batch, labels)
    with LiveBytes() as plain_live:
        logits = plain(**batch).logits.to(torch.float32)
    assert logps.shape == (8, 31) and sums.shape == (8, 32) and vocab_size == VOCAB
    logits_bytes = logits.numel() * 4
    assert plain_live.live - fused_live.live >= 0.9 * logits_bytes, (plain_live.live, fused_live.live, logits_bytes)


def test_fp32_results_survive_a_bf16_output_cast():
    """FSDP2 under accelerate's bf16 casts every floating output of a unit (and the root) to bf16: a per-token
    log-prob of about -12 would move by up to 0.03. Carried as two parts it keeps 16 bits; the gradient is what any
    cast output gets (the incoming gradient in bf16), not doubled or lost."""
    from llamafactory_liger_fsdp import fp32_limbs

    x = (-12 * torch.rand(4096, dtype=torch.float64)).float().requires_grad_()
    marker, hi, lo = fp32_limbs.split_fp32(x)
    cast = fp32_limbs.join_fp32((marker, hi.to(torch.bfloat16), lo.to(torch.bfloat16)))  # what the unit hands back
    assert (cast - x).abs().max().item() <= 12 * 2.0**-16
    assert (x.to(torch.bfloat16).float() - x).abs().max().item() > 12 * 2.0**-12  # a plain cast loses far more
    weights = torch.randn(4096)
    (cast * weights).sum().backward()
    assert torch.equal(x.grad, weights.to(torch.bfloat16).float())


def _run_stage(tmp_path, stage, seed, dtype=torch.float32):
    """Two steps of a DPO / KTO stage through LLaMA-Factory's trainer with the flag on."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto.trainer import CustomKTOTrainer

    plain, fused = _twins("mts")
    plain.train(), fused.train().to(dtype)
    batch = _pairs(seed=seed)
    if stage == "kto":
        trainer = _trainer(CustomKTOTrainer, tmp_path, plain, stage="kto")
        batch.update({f"kl_{k}": v for k, v in _pairs(seed=seed + 1).items()},
                     kto_tags=torch.tensor([True, False, True, False]))
    else:
        trainer = _trainer(CustomDPOTrainer, tmp_path, plain, stage="dpo", pref_loss="sigmoid")
    setattr(trainer.finetuning_args, config.ATTR, ON)
    for _ in range(2):
        trainer.get_batch_loss_metrics(fused, dict(batch))


METHOD = {"dpo": "CustomDPOTrainer.concatenated_forward", "kto": "CustomKTOTrainer.forward"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_guard_holds_the_replaced_method_against_llamafactorys(tmp_path, stage, dtype, capsys, monkeypatch):
    """Step 1 runs LLaMA-Factory's own method (the model's own forward, fp32 logits) and the replacement on a slice of
    the batch: once, on the policy's first call with gradients (not the reference pass, not KTO's KL pass), exact on an
    honest run; a 1% error in what ``forward.token_logps`` hands the trainer (after the units and fp32 limbs) stops
    it with the method, the key and the fix named."""
    from llamafactory_liger_fsdp import forward
    from llamafactory_liger_fsdp.config import LigerFsdpConfigError
    from support import names_key_and_fix

    _run_stage(tmp_path, stage, 31, dtype)
    lines = [l for l in capsys.readouterr().err.splitlines() if "guard:" in l]
    assert len(lines) == 1 and f"guard: step 1 exact: LLaMA-Factory's {METHOD[stage]}" in lines[0], lines
    honest = forward.token_logps

    def off(*a, **k):
        logps, sums, vocab = honest(*a, **k)
        return logps * 1.01, sums, vocab

    monkeypatch.setattr(forward, "token_logps", off)
    with pytest.raises(LigerFsdpConfigError) as exc:
        _run_stage(tmp_path, stage, 41, dtype)
    msg = str(exc.value)
    assert f"replacement of LLaMA-Factory's {METHOD[stage]} does not give what LLaMA-Factory's own gives" in msg
    names_key_and_fix(msg, "liger_fsdp_guard", "remove `liger_fsdp`")


def test_a_changed_llamafactory_method_stops_the_run(tmp_path, monkeypatch):
    """A release whose ``concatenated_forward`` averages differently (here: sigmoid log-probs halved) is not silently
    replaced by the plugin's copy of 0.9.5's: step 1 stops naming the method and the LLaMA-Factory version."""
    from importlib.metadata import version

    from llamafactory.train.dpo import trainer as dpo

    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp.config import LigerFsdpConfigError
    from llamafactory_liger_fsdp.integration import preference as integration

    _patch.undo(dpo.CustomDPOTrainer, "concatenated_forward")
    released = dpo.CustomDPOTrainer.concatenated_forward

    def newer(self, model, batch, is_ref_model=False):
        out = released(self, model, batch, is_ref_model)
        return {**out, "chosen_logps": out["chosen_logps"] / 2, "rejected_logps": out["rejected_logps"] / 2}

    monkeypatch.setattr(dpo.CustomDPOTrainer, "concatenated_forward", newer)
    try:
        integration.patch_dpo(dpo)
        with pytest.raises(LigerFsdpConfigError) as exc:
            _run_stage(tmp_path, "dpo", 7)
    finally:
        _patch.undo(dpo.CustomDPOTrainer, "concatenated_forward")
    monkeypatch.undo()
    integration.patch_dpo(dpo)  # as the module fixture left it
    msg = str(exc.value)
    assert "LLaMA-Factory's CustomDPOTrainer.concatenated_forward does not give what LLaMA-Factory's own gives" in msg
    assert "chosen_logps" in msg and f"llamafactory {version('llamafactory')}" in msg
