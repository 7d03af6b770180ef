"""The first-step exactness guard: passes on every family (fp32, bf16, fp16), catches a planted wrong quirk and an
injected 1% loss error in bf16 and fp16 with both numbers and the key, names ids outside the vocabulary as a data
error (`resize_vocab`), lets other errors through unchanged, defers a step without labels, says the global step, runs
once, keeps the real step's RNG, and `liger_fsdp_guard: false` turns it off. (Every family of test_families.py also
asserts the guard's "exact" line; the 2-rank decisions are in test_guard_dist.py.)"""

import dataclasses

import pytest
import torch

from llamafactory_liger_fsdp import config as cfg_mod
from llamafactory_liger_fsdp import families, guard
from llamafactory_liger_fsdp.config import LigerFsdpConfig, LigerFsdpConfigError
from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.testing import FAMILY_CONFIGS, make_batch, make_inputs, twin
from support import names_key_and_fix

EXACT = "[liger_fsdp] guard: step 1 exact: model's own loss"


def _loud(model, factor=10.0):
    """Logits ~10x larger than the random init gives, so a softcap really bends them (|z| >> cap)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model


def _plant(monkeypatch, name, **wrong):
    monkeypatch.setitem(families.FAMILIES, name, dataclasses.replace(families.FAMILIES[name], **wrong))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_passes_on_core_families(family, capsys):
    _, cand = twin(family, "mts")
    engage(cand, backend="torch")
    cand(**make_batch())
    assert EXACT in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama", "gemma2", "cohere", "granite", "qwen2_vl", "gemma3", "mixtral"])
def test_passes_in_bf16_with_large_logits(name, capsys):
    _, cand = twin(name, "full")
    _loud(cand, 4.0).to(torch.bfloat16)
    engage(cand, backend="torch")
    cand(**make_inputs(name))
    err = capsys.readouterr().err
    assert EXACT in err and "fp32 logits from the same bfloat16 inputs" in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,wrong", [("granite", dict(scale=None)), ("cohere", dict(scale=None)),
                                        ("gemma2", dict(softcap=None))])
def test_catches_a_planted_quirk(name, wrong, dtype, monkeypatch):
    _plant(monkeypatch, name, **wrong)
    _, cand = twin(name, "mts")
    _loud(cand.base_model.model).to(dtype)
    engage(cand, backend="torch")
    with pytest.raises(LigerFsdpConfigError) as exc:
        cand(**make_inputs(name))
    msg = str(exc.value)
    assert f"model type `{name}`" in msg and "model's own loss" in msg and "fused loss" in msg
    names_key_and_fix(msg, "liger_fsdp_guard", "remove `liger_fsdp`")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,head", [("llama", "mts"), ("qwen2", "lora"), ("gemma2", "full"), ("granite", "mts"),
                                       ("mixtral", "lora"), ("qwen2_vl", "mts")])
def test_catches_an_injected_one_percent_error(name, head, dtype, monkeypatch):
    """The size of error Liger's own loss makes with a LoRA head under ZeRO-3: a 16-bit run must not pass it."""
    from llamafactory_liger_fsdp import losses

    honest = losses.HeadLoss.loss
    monkeypatch.setattr(losses.HeadLoss, "loss", lambda self, *a, **k: honest(self, *a, **k) * 1.01)
    _, cand = twin(name, head)
    cand.to(dtype)
    engage(cand, backend="torch")
    with pytest.raises(LigerFsdpConfigError) as exc:
        cand(**make_inputs(name))
    assert f"model type `{name}`" in str(exc.value) and f"from the same {str(dtype)[6:]} inputs" in str(exc.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head", ["mts", "lora", "full"])
def test_no_false_alarm_in_16_bits(head, dtype, capsys):
    """Honest runs in 16 bits pass the tighter bound (bench/guard_bounds.py measures every family)."""
    for name in ("llama", "cohere", "gemma2", "qwen3_moe"):
        _, cand = twin(name, head)
        _loud(cand.get_base_model() if head != "full" else cand, 3.0).to(dtype)
        engage(cand, backend="torch")
        cand(**make_batch(batch=3, seq=40))
        assert EXACT in capsys.readouterr().err, name


def test_an_error_of_the_model_itself_is_not_a_mismatch(monkeypatch):
    """Out of memory, collective failures, shape bugs: the same exception propagates, with a note saying where."""
    _, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    decoder = cand.get_base_model().model

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(decoder, "forward", broken)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as exc:
        cand(**make_batch())
    assert any("first-step guard" in note for note in getattr(exc.value, "__notes__", []))


@pytest.mark.parametrize("where", ["input_ids", "labels"])
def test_ids_outside_the_vocabulary_are_a_data_error(where):
    """A tokenizer with added tokens and no `resize_vocab`: the run without the flag fails too (IndexError in the
    embedding); the guard names the data and the key that fixes it, not the model."""
    from llamafactory_liger_fsdp.config import LigerFsdpDataError

    _, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    batch = make_batch()
    batch[where][1, 5] = 384 + 3  # VOCAB rows
    with pytest.raises(LigerFsdpDataError) as exc:
        cand(**batch)
    assert "387" in str(exc.value)
    names_key_and_fix(str(exc.value), "resize_vocab", "resize_vocab: true")


def test_off_by_key(monkeypatch, capsys):
    assert cfg_mod.from_mapping({"liger_fsdp": True}).guard is True
    assert cfg_mod.from_mapping({"liger_fsdp": True, "liger_fsdp_guard": "false"}).guard is False
    _plant(monkeypatch, "granite", scale=None)
    _, cand = twin("granite", "full")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", guard=False))
    cand(**make_batch())  # wrong, and not checked
    err = capsys.readouterr().err
    assert "guard=off" in err and "guard:" not in err


def test_once_and_the_real_step_keeps_its_rng(capsys):
    """LoRA dropout: the guard draws its masks from a copy of the RNG state; the real steps equal the
    reference's, drawn from the same seeds."""
    ref, cand = twin("qwen2", "lora", dropout=0.3)
    engage(cand, backend="torch")
    for step in range(2):
        torch.manual_seed(step)
        lr = ref(**make_batch(seed=step)).loss
        torch.manual_seed(step)
        lc = cand(**make_batch(seed=step)).loss
        assert abs(lr.item() - lc.item()) <= 1e-5 * lr.item()
    assert capsys.readouterr().err.count(EXACT) == 1


def test_slice_is_one_row_of_at_most_budget_positions(monkeypatch, capsys):
    """Text only: both sides run the decoder on one row cut to at most BUDGET positions (the row with the most labels
    there), so the guard's cost does not grow with the context."""
    from llamafactory_liger_fsdp import guard_slice

    seen = []
    original = guard_slice.cut

    def spy(batch, piece, b, t):
        small = original(batch, piece, b, t)
        seen.append((tuple(small["input_ids"].shape), tuple(small["labels"].shape), piece.rows))
        return small

    monkeypatch.setattr(guard_slice, "cut", spy)
    _, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    batch = make_batch(batch=3, seq=300)
    batch["labels"][0, -200:] = -100  # row 0 has fewer labels in the window than rows 1, 2
    cand(**batch)
    assert seen == [((1, guard.BUDGET), (1, guard.BUDGET), [1])]
    assert EXACT in capsys.readouterr().err


def test_a_step_without_labels_defers_the_check(capsys):
    """With gradient accumulation 2 (the second micro-batch of step 1 and step 2's first have labels)."""
    ref, cand = twin("llama", "mts")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", grad_accum=2))
    empty = make_batch()
    empty["labels"][:] = -100
    loss = cand(**empty).loss
    assert torch.isnan(loss) and torch.isnan(ref(**empty).loss)  # 0 / 0, as the model's own mean
    assert "guard:" not in capsys.readouterr().err
    cand(**empty).loss.backward()
    cand(**make_batch()).loss.backward()
    assert "[liger_fsdp] guard: step 2 exact" in capsys.readouterr().err
    assert all(torch.isfinite(p.grad).all() for p in cand.parameters() if p.grad is not None)


def test_the_line_says_the_global_step_after_a_resume(capsys):
    _, cand = twin("llama", "mts")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", start_step=2, grad_accum=4))
    cand(**make_batch())
    assert "[liger_fsdp] guard: step 3 exact" in capsys.readouterr().err


def test_bounds_stated():
    assert guard.bounds(torch.float32) == (1e-4, 1e-6)
    assert guard.bounds(torch.bfloat16) == guard.bounds(torch.float16) == (2e-3, 1e-4)


def test_checks_a_packed_row_that_ends_in_padding(capsys):
    """LLaMA-Factory's packing (and right padding) ends a row in unlabelled padding: the slice ends at the last
    labelled position instead of finding nothing to check (seen on the H200 with packing at 16k tokens)."""
    _, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    batch = make_batch(batch=1, seq=400, ignore_frac=0.1)
    batch["labels"][:, 300:] = -100  # 100 positions of padding at the end, more than 256 labelled before
    cand(**batch)
    err = capsys.readouterr().err
    assert EXACT in err and "positions 44-299" in err, err
