"""Steps with no labelled token through real `llamafactory-cli train` runs.

The realistic repro: `template: empty`, every second answer empty (`tiny_empty_answers`), batch size 1, LoRA +
`additional_target: embed_tokens,lm_head`. The Trainer's loss there is `0 / 0` (NaN, logged as 0.0 by its NaN
filter) with zero gradients, with or without the flag; before the fix the flag made every trainable weight NaN from
the first such step. Checked on one process and under FSDP2 (2 CPU ranks; ZeRO-3 at the torch level: tests/test_ds_parity.py's `:empty`
case; a micro-batch without labels inside an accumulated step is `0 / N`, harmless, and is covered by the kernel
tests):
per-step losses equal the run without the flag, the saved adapter is finite and equal to it; with `cutoff_len: 1`
(every step empty) the adapter is the untrained one."""

import pytest
import torch

from support.cli import FSDP2, base_yaml, run_cli

pytestmark = pytest.mark.slow
TOL = 1e-4


def _adapter(out):
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def _pair(assets, tmp_path, nproc=None, **extra):
    runs = []
    for flag in (False, True):
        out = tmp_path / f"{'liger' if flag else 'plain'}"
        keys = dict(dict(dataset="tiny_empty_answers", template="empty", per_device_train_batch_size=1,
                         gradient_accumulation_steps=1, max_steps=12), **extra)
        cfg = base_yaml(assets, out, **keys, **({"liger_fsdp": True} if flag else {}))
        rc, log, losses = run_cli(cfg, nproc=nproc)
        assert rc == 0, log[-6000:]
        runs.append((log, losses, _adapter(out)))
    (_, plain, plain_w), (log, fused, fused_w) = runs
    assert "[liger_fsdp] engaged" in log
    assert plain.count(0.0) >= 1 and sum(x > 0 for x in plain) >= 2, plain  # steps without labels, and with
    assert len(fused) == len(plain) and all(abs(a - b) <= TOL * max(abs(b), 1) for a, b in zip(fused, plain)), (fused, plain)
    assert plain_w.keys() == fused_w.keys()
    for key, want in plain_w.items():
        got = fused_w[key]
        assert torch.isfinite(got).all(), key
        assert (got - want).norm() <= TOL * max(want.norm(), 1e-6), key
    return log


def test_one_process(assets, tmp_path):
    _pair(assets, tmp_path)


def test_fsdp2_two_ranks(assets, tmp_path):
    """(`num_items_in_batch` counts both ranks' labels: a step is 0 / 0 when neither rank has one.)"""
    log = _pair(assets, tmp_path, nproc=2, max_steps=10, **FSDP2)
    assert "sharding=FSDP2" in log


def test_every_step_empty(assets, tmp_path):
    """`cutoff_len: 1`: no step has a labelled token; nothing may move (AdamW on zero gradients), nothing is NaN."""
    out = tmp_path / "cut"
    cfg = base_yaml(assets, out, cutoff_len=1, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                    max_steps=3, liger_fsdp=True)
    rc, log, losses = run_cli(cfg)
    assert rc == 0, log[-6000:]
    assert losses == [0.0, 0.0, 0.0] and "guard:" not in log  # the guard waits for a step with labels
    weights = _adapter(out)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert all(not w.any() for k, w in weights.items() if "lora_B" in k)  # still PEFT's zero init
