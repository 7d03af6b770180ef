"""Newer library versions through real `llamafactory-cli train` runs (one CPU process): the run trains with one line
naming the untested version, and when that newer library changed what the loss sees (simulated by
tests/newer_library_shim: transformers reports 5.99.0 and Llama's class forward halves its logits before the loss),
the first-step guard stops the run with its message, naming the untested version and the fix."""

from pathlib import Path

import pytest

from llamafactory_liger_fsdp import versions
from support.cli import base_yaml, run_cli

pytestmark = pytest.mark.slow
SHIM = str(Path(__file__).resolve().parent / "newer_library_shim")
NEWER = {"PYTHONPATH": SHIM, "NEWER_LIBRARY_VERSION": "5.99.0", "DISABLE_VERSION_CHECK": "1"}
UNTESTED = (f"[liger_fsdp] untested versions: transformers 5.99.0 (tested up to {versions.TESTED['transformers']}); "
            "training as usual")  # the only untested line on each stack CI runs (its versions make the table)


def test_newer_version_trains_and_says_so_once(assets, tmp_path):
    rc, log, losses = run_cli(base_yaml(assets, tmp_path / "newer", liger_fsdp=True, max_steps=2), extra_env=NEWER)
    assert rc == 0, log[-6000:]
    assert log.count(UNTESTED) == 1
    assert "[liger_fsdp] engaged" in log and "[liger_fsdp] guard: step 1 exact" in log and len(losses) == 2


def test_guard_stops_a_newer_library_that_changed_the_loss(assets, tmp_path):
    rc, log, _ = run_cli(base_yaml(assets, tmp_path / "changed", liger_fsdp=True, max_steps=2),
                         extra_env=dict(NEWER, NEWER_LIBRARY_CHANGES_LOSS="1"))
    assert "[newer_library_shim] LlamaForCausalLM.forward halves its logits" in log  # the change really ran
    assert rc != 0 and log.count(UNTESTED) == 1
    error = log.strip().splitlines()[-1]  # the stop ends the process as one message, last, with no traceback
    assert error.startswith("[liger_fsdp] error: `liger_fsdp_guard`: ") and "Traceback" not in log, log[-3000:]
    assert "on step 1 the fused loss is not the model's own for model type `llama`" in error
    assert "Installed versions newer than tested: transformers 5.99.0" in error
    assert "Fix: install the tested versions" in error and "or remove `liger_fsdp`" in error
    assert "[liger_fsdp] guard: step 1 exact" not in log
