"""Real `llamafactory-cli train` runs on a tiny local model, tokenizer and dataset (CPU).

2 ranks with FORCE_TORCHRUN=1 under FSDP2 in bf16 (accelerate forced to FSDP on CPU by the test-only shim in
llamafactory_liger_fsdp/testing/cpu_fsdp_shim), one process for LoRA on the head, refusals before any rank starts,
the off switch and the
`train` command without the .pth hook. With `liger_fsdp: true` the per-step losses equal those of the same run without
the flag. The fp32 FSDP2 / FSDP1 parity runs on 2 ranks: tests/test_e2e_checkpoints.py (they share its runs)."""

import re
import warnings

import pytest

from support.cli import FSDP2, assert_same_losses, base_yaml, run_cli

pytestmark = pytest.mark.slow


def test_fsdp2_bf16_frozen_weights_stay_16bit(assets, tmp_path):
    """bf16 mixed precision: accelerate's FSDP2 preparation upcasts every parameter to fp32; with the plugin the frozen
    ones go back to bf16 (one line says so) and the run's losses are the plain bf16 run's (bf16 rounding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model_bf16"  # saved in bf16, so LLaMA-Factory loads it in bf16 (as a real checkpoint)
    AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.bfloat16).save_pretrained(model_dir)
    for f in (assets / "model").iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            (model_dir / f.name).write_bytes(f.read_bytes())
    bf16 = dict(FSDP2, bf16=True, use_cpu=True, model_name_or_path=str(model_dir))
    rc, log, plain = run_cli(base_yaml(assets, tmp_path / "plain", **bf16), nproc=2)
    assert rc == 0, log[-6000:]
    rc, log, fused = run_cli(base_yaml(assets, tmp_path / "fused", liger_fsdp=True, **bf16), nproc=2)
    assert rc == 0, log[-6000:]
    said = [l for l in log.splitlines() if "[liger_fsdp] FSDP2:" in l]
    assert len(said) == 1 and re.search(r"FSDP2: \d+ frozen parameter\(s\) kept in the dtype they were loaded in", said[0])
    assert "the original weights freed as they were sharded" in said[0], said[0]
    assert len(fused) == len(plain) == 6
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(fused, plain)), (fused, plain)


def test_lora_on_head_one_process(assets, tmp_path):
    cfg = dict(lora_target="q_proj,v_proj,lm_head", additional_target=None)
    rc, log, ref = run_cli(base_yaml(assets, tmp_path / "plain", **cfg))
    assert rc == 0, log[-6000:]
    rc, log, losses = run_cli(base_yaml(assets, tmp_path / "liger", liger_fsdp=True, **cfg))
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] engaged: head=lora (lm_head), sharding=none" in log
    assert_same_losses(losses, ref)


def test_frozen_head_says_why(assets, tmp_path):
    rc, log, _ = run_cli(base_yaml(assets, tmp_path / "frozen", liger_fsdp=True, additional_target=None, max_steps=1))
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] not engaged: lm_head is frozen" in log


@pytest.mark.parametrize("bad,key", [
    (dict(lora_target="q_proj,lm_head", use_dora=True, additional_target=None), "use_dora: true"),
    (dict(liger_fsdp_backend="triton"), "liger_fsdp_backend: triton")])
def test_refused_once_before_any_rank_starts(assets, tmp_path, bad, key):
    """What the yaml alone decides is said once, by the launching process, as the last line (DoRA on the head, and a
    Triton backend on a machine without CUDA: the launcher's own environment decides it). Every refusal of the
    launcher's precheck, in process: test_config_errors.py::test_launcher_precheck_refuses."""
    rc, log, _ = run_cli(base_yaml(assets, tmp_path / "bad", liger_fsdp=True, **bad), nproc=2,
                         extra_env={"TRITON_INTERPRET": None})
    assert rc != 0
    assert log.count("[liger_fsdp] error:") == 1, log[-3000:]
    assert log.strip().splitlines()[-1].startswith("[liger_fsdp] error: "), log[-3000:]
    assert f"`{key}" in log.strip().splitlines()[-1]
    assert "Initializing 2 distributed tasks" not in log and "ChildFailedError" not in log and "Traceback" not in log


def test_disabled_said_once_and_misspelled_keys_still_caught(assets, tmp_path):
    off = {"LLAMAFACTORY_LIGER_FSDP_DISABLE": "1"}
    cfg = base_yaml(assets, tmp_path / "disabled", liger_fsdp=True, liger_fsdp_guard=False, max_steps=1)
    rc, log, _ = run_cli(cfg, nproc=2, extra_env=off)
    assert rc == 0, log[-6000:]
    assert log.count("the liger_fsdp keys are accepted and ignored") == 1, log[-6000:]  # launcher, not again in rank 0
    assert "[liger_fsdp] engaged" not in log and "[liger_fsdp] patched" not in log
    cfg = base_yaml(assets, tmp_path / "typo", liger_fsdp=True, liger_fsdp_gaurd=False, max_steps=1)
    rc, log, _ = run_cli(cfg, nproc=2, extra_env=off)
    assert rc != 0 and log.strip().splitlines()[-1].startswith("[liger_fsdp] error: Unknown key(s) `liger_fsdp_gaurd`")


def test_train_command_activates_without_the_pth_hook(assets, tmp_path):
    """Where the .pth hook does not run, `python -m llamafactory_liger_fsdp train` activates the plugin in the
    launcher and in every torchrun worker."""
    no_pth = {"LLAMAFACTORY_LIGER_FSDP_PTH": "0"}
    cfg = base_yaml(assets, tmp_path / "off", liger_fsdp=True, max_steps=2)
    rc, log, _ = run_cli(cfg, nproc=2, extra_env=no_pth)
    assert rc != 0 and "Some keys are not used by the HfArgumentParser: ['liger_fsdp']" in log  # really inactive
    cfg = base_yaml(assets, tmp_path / "on", liger_fsdp=True, max_steps=2)
    # no other sitecustomize on the path (the CPU FSDP shim is one): DDP on 2 ranks
    rc, log, losses = run_cli(cfg, nproc=2, extra_env=no_pth, module_train=True, shim=False)
    # Known, not ours: with both cores busy, rank 1 aborted ("terminate called without an active exception", SIGABRT)
    # after training while rank 0 saved, in 3 of 162 runs (0 of 16 idle) -- the gloo exit race the CPU shim and
    # tests/support/dist.py step around; this run has no shim by design. Measured: under DDP, torch keeps the gloo group
    # (its two pt_gloo_runloop threads) alive past LLaMA-Factory's unbarriered destroy_process_group and a gc.collect()
    # (not so without DDP), so the group is only torn down by the process exit. That exact abort, after both steps
    # were logged, is run once more in a fresh directory; the second run must pass whole.
    if rc != 0 and "terminate called without an active exception" in log and len(losses) == 2:
        warnings.warn("gloo exit abort after training (torch's DDP teardown race); running once more")
        cfg = base_yaml(assets, tmp_path / "on_again", liger_fsdp=True, max_steps=2)
        rc, log, losses = run_cli(cfg, nproc=2, extra_env=no_pth, module_train=True, shim=False)
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=DDP" in log and len(losses) == 2
    assert "sitecustomize" not in log, log[-6000:]  # was: "Error in sitecustomize ... KeyError" in every worker
    # what this SFT run patched, and nothing else (no DPO/KTO trainer, no Trainer.__init__ without label smoothing)
    patched = [l.split("patched ", 1)[1].split(":")[0] for l in log.splitlines() if "[liger_fsdp] patched" in l]
    assert sorted(set(patched)) == ["llamafactory.hparams.parser._parse_args", "llamafactory.hparams.parser.get_train_args",
                                    "llamafactory.model.loader.load_model"], patched
