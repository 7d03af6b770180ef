"""Every way a run is started, and every key it accepts: LLaMA-Factory's switches read as LLaMA-Factory reads them,
refusals on the argv form, before `accelerate launch` starts a rank, one line from a rank; keys that would do nothing
refused with the right spelling; the once-per-run lines said once per run (not once per process, nothing left in the
environment); the version table from the stacks CI runs; doctor's smaller answers. In process; the launches are in
test_refusal_launches.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from llamafactory_liger_fsdp import _log, config, doctor, refusals, versions
from llamafactory_liger_fsdp.integration.v1 import args as v1_args
from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from support import names_key_and_fix, sft_args, train_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def base(assets, tmp_path):
    return sft_args(assets, tmp_path)


def _argv(values: dict) -> list[str]:
    return [item for k, v in values.items() for item in (f"--{k}", str(v))]


# ----------------------------------------------------------------------------------------- point 4: switches, argv
@pytest.mark.parametrize("value", ["y", "Y", "true", "1"])
def test_use_mca_read_as_llamafactory_reads_it(base, monkeypatch, value):
    """LLaMA-Factory turns USE_MCA on for true / y / 1 (its is_env_enabled): so does the refusal."""
    from llamafactory.extras.misc import is_env_enabled

    monkeypatch.setenv("USE_MCA", value)
    assert is_env_enabled("USE_MCA")
    with pytest.raises(LigerFsdpConfigError) as err:
        refusals.check_raw(base)
    assert f"with USE_MCA={value} (`use_mca`)" in str(err.value) and "Fix: unset USE_MCA" in str(err.value)


def test_switches_off_where_llamafactory_reads_them_off(base, monkeypatch):
    from llamafactory.extras.misc import is_env_enabled

    from llamafactory_liger_fsdp.args import env_enabled

    for value in ("yes", "on", "0", "false", ""):
        monkeypatch.setenv("USE_MEGATRON_BRIDGE", value)
        assert env_enabled("USE_MEGATRON_BRIDGE") is is_env_enabled("USE_MEGATRON_BRIDGE") is False, value
        refusals.check_raw(base)


def test_launcher_refuses_the_argv_form(base, monkeypatch):
    """`llamafactory-cli train --key value ...`: the launching process checks it like a yaml."""
    from llamafactory_liger_fsdp.integration.launch import precheck

    monkeypatch.setenv("USE_MCA", "1")
    with pytest.raises(LigerFsdpConfigError, match="USE_MCA=1"):
        precheck(_argv(dict(base, liger_fsdp="true")))
    monkeypatch.delenv("USE_MCA")
    with pytest.raises(LigerFsdpConfigError, match="use_unsloth"):
        precheck(_argv(dict(base, liger_fsdp="true", use_unsloth="true")))
    with pytest.raises(LigerFsdpConfigError, match="liger_fsdp_gaurd"):
        precheck(_argv(dict(base, liger_fsdp="true", liger_fsdp_gaurd="false")))
    precheck(_argv(dict(base, liger_fsdp="true")))  # a good run passes


# ------------------------------------------------------------------------------ point 5: keys that would do nothing
@pytest.mark.parametrize("key,value,right", [("guard", False, "liger_fsdp_guard"),
                                             ("backend", "triton", "liger_fsdp_backend"),
                                             ("memory_report", True, "liger_fsdp_memory_report")])
def test_v1_unprefixed_keys_refused_with_the_right_spelling(key, value, right):
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.config_of({"name": "liger_fsdp", key: value})
    names_key_and_fix(str(err.value), f"kernel_config.{key}", f"`kernel_config.{right}`")


@pytest.mark.parametrize("name", ["liger-fsdp", "Liger_FSDP", "liger_kernel,liger-fsdp"])
def test_v1_misspelled_kernel_name_refused(name):
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.config_of({"name": name})
    names_key_and_fix(str(err.value), f"kernel_config.name: {name}", "write `liger_fsdp`")


def test_v1_list_form_where_the_installed_v1_takes_one_name():
    pytest.importorskip("llamafactory.v1")
    from llamafactory.v1.plugins.model_plugins.kernels import interface

    from llamafactory_liger_fsdp.integration.v1 import engine as v1

    assert v1.takes_list() is hasattr(interface, "apply_kernels")
    listed = {"name": "liger_kernel,liger_fsdp"}
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.check_name_form(listed, takes_list=False)
    names_key_and_fix(str(err.value), "kernel_config.name: liger_kernel,liger_fsdp", "`kernel_config.name: liger_fsdp`")
    v1_args.check_name_form(listed, takes_list=True)
    if v1.takes_list():
        assert v1.check_kernel_config(listed).enabled
    else:
        with pytest.raises(LigerFsdpConfigError, match="takes one kernel name"):
            v1.check_kernel_config(listed)


def _v1_recipe() -> str:
    return str(ROOT / "recipes" / "tiny_cpu" / "v1_sft.yaml")


@pytest.mark.parametrize("override", ["kernel_config.name=liger-fsdp", "kernel_config.guard=false",
                                      "kernel_config.liger_fsdp_checkpoint_repair=false"])
def test_doctor_fails_on_keys_that_would_do_nothing(assets, monkeypatch, capsys, override):
    pytest.importorskip("llamafactory.v1")
    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    assert doctor.main(["doctor", _v1_recipe(), f"model={assets / 'model'}", override]) == 1
    out = capsys.readouterr().out
    assert "error: `kernel_config." in out and "will engage" not in out, out


def test_doctor_fails_on_a_list_the_installed_v1_cannot_take(assets, monkeypatch, capsys):
    pytest.importorskip("llamafactory.v1")
    from llamafactory_liger_fsdp.integration.v1 import engine as v1

    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    rc = doctor.main(["doctor", _v1_recipe(), f"model={assets / 'model'}", "kernel_config.name=liger_kernel,liger_fsdp"])
    out = capsys.readouterr().out
    assert rc == (0 if v1.takes_list() else 1), out


@pytest.mark.parametrize("kernel_config", ["{name: liger-fsdp}", "{name: liger_fsdp, guard: false}"])
def test_v1_launcher_refuses_them_before_any_rank(tmp_path, kernel_config):
    pytest.importorskip("llamafactory.v1")
    from llamafactory_liger_fsdp.integration.v1 import engine as v1

    path = tmp_path / "v1.yaml"
    path.write_text(f"model: whatever\nkernel_config: {kernel_config}\n")
    with pytest.raises(LigerFsdpConfigError, match="kernel_config"):
        v1.precheck("sft", [str(path)])


def test_v1_checkpoint_repair_refused():
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.config_of({"name": "liger_fsdp", "liger_fsdp_checkpoint_repair": True})
    names_key_and_fix(str(err.value), "kernel_config.liger_fsdp_checkpoint_repair", "remove")


def test_the_old_override_key_says_it_does_nothing_once_per_run(base, capsys):
    said = "[liger_fsdp] `liger_fsdp_allow_untested_versions` no longer does anything"
    train_args(dict(base, liger_fsdp=True, liger_fsdp_allow_untested_versions=True))
    assert capsys.readouterr().err.count(said) == 1
    train_args(dict(base, liger_fsdp=True))
    assert said not in capsys.readouterr().err


def test_v1_disabled_by_its_own_key_names_that_key(monkeypatch, capsys):
    pytest.importorskip("llamafactory.v1")
    from llamafactory_liger_fsdp.integration.v1 import engine as v1
    from llamafactory_liger_fsdp.testing import make_model

    monkeypatch.delenv(config.DISABLE_ENV, raising=False)
    monkeypatch.setitem(v1._RUN, "config", None)
    _log.new_run()
    model = make_model("llama")
    assert v1.engage_v1(model, {"name": "liger_fsdp", "liger_fsdp": False}) is model
    err = capsys.readouterr().err
    assert "[liger_fsdp] `kernel_config.liger_fsdp: false`: kernel `liger_fsdp` does nothing" in err, err
    assert config.DISABLE_ENV not in err


def test_doctor_names_the_v1_key_that_turns_the_plugin_off(assets, monkeypatch, capsys):
    pytest.importorskip("llamafactory.v1")
    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    monkeypatch.delenv(config.DISABLE_ENV, raising=False)
    assert doctor.main(["doctor", _v1_recipe(), f"model={assets / 'model'}", "kernel_config.liger_fsdp=false"]) == 0
    assert "plugin off (`kernel_config.liger_fsdp: false`)" in capsys.readouterr().out


# ------------------------------------------------------------------------ point 6: accelerate launch, ranks' errors
def test_accelerate_launch_command_is_hooked(tmp_path, base, capsys):
    """The accelerate CLI's launch command (patched by the import hook) checks the training script's arguments before
    it starts any process: one message, exit 1."""
    from accelerate.commands import launch as accelerate_launch

    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp.integration import launch

    assert getattr(accelerate_launch.launch_command, _patch.MARK, False)
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(dict(base, liger_fsdp=True, liger_fsdp_gaurd=True)))
    args = SimpleNamespace(training_script="llamafactory.launcher", module=True, training_script_args=[str(path)])
    with pytest.raises(SystemExit) as done:
        accelerate_launch.launch_command(args)
    assert done.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("[liger_fsdp] error: Unknown key(s) `liger_fsdp_gaurd`"), err
    assert sum("error" in line for line in err) == 1, err
    called = []
    fake = SimpleNamespace(__name__="fake_accelerate_launch", launch_command=lambda args: called.append(args))
    launch.patch_accelerate_launch(fake)
    try:
        for other in (["--lr", "0.1"], [str(tmp_path / "missing.yaml")], [str(tmp_path / "absent.json"), "x=1"]):
            fake.launch_command(SimpleNamespace(training_script="train.py", training_script_args=other))
    finally:
        _patch.undo(fake, "launch_command")
    assert len(called) == 3  # another script's arguments: accelerate goes on


@pytest.mark.parametrize("script,use_v1", [("llamafactory.v1.launcher", None), ("llamafactory.cli", "1")])
def test_accelerate_launch_checks_a_v1_command(tmp_path, monkeypatch, capsys, script, use_v1):
    """``accelerate launch -m llamafactory.v1.launcher sft <yaml>`` (or LLaMA-Factory's CLI under USE_V1=1): the v1
    yaml is checked as v1's launcher checks it, before accelerate starts any process; a good one goes on."""
    pytest.importorskip("llamafactory.v1")
    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp.integration import launch

    monkeypatch.delenv("USE_V1", raising=False)
    if use_v1:
        monkeypatch.setenv("USE_V1", use_v1)
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("model: whatever\nkernel_config: {name: liger_fsdp, guard: false}\n")
    good.write_text("model: whatever\nkernel_config: {name: liger_fsdp}\n")
    called = []
    fake = SimpleNamespace(__name__="fake_accelerate_launch", launch_command=lambda args: called.append(args))
    launch.patch_accelerate_launch(fake)
    try:
        with pytest.raises(SystemExit) as done:
            fake.launch_command(SimpleNamespace(training_script=script, module=True,
                                                training_script_args=["sft", str(bad)]))
        assert done.value.code == 1 and not called
        err = capsys.readouterr().err.strip().splitlines()
        names_key_and_fix(err[-1], "kernel_config.guard", "`kernel_config.liger_fsdp_guard`")
        fake.launch_command(SimpleNamespace(training_script=script, module=True, training_script_args=["sft", str(good)]))
        assert len(called) == 1
    finally:
        _patch.undo(fake, "launch_command")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_refusal_in_a_rank_is_one_line_from_rank_0(monkeypatch, capsys, rank):
    for key, value in dict(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    with pytest.raises(LigerFsdpConfigError):
        with _log.one_message_per_run():
            raise LigerFsdpConfigError("`liger_fsdp_x`: no. Fix: yes.")
    try:
        raise LigerFsdpConfigError("`liger_fsdp_x`: no. Fix: yes.")
    except LigerFsdpConfigError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert err == ("[liger_fsdp] error: `liger_fsdp_x`: no. Fix: yes.\n" if rank == 0 else ""), err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------- point 7: one run's state
def test_two_runs_in_one_process_both_say_their_lines(base, monkeypatch, capsys):
    monkeypatch.setattr(versions, "installed", lambda name: {"transformers": "5.99.0"}.get(name))
    line = "[liger_fsdp] untested versions: transformers 5.99.0"
    for _ in range(2):
        train_args(dict(base, liger_fsdp=True))
        assert capsys.readouterr().err.count(line) == 1
    assert not [k for k in os.environ if k.startswith("LLAMAFACTORY_LIGER_FSDP_SAID")]  # nothing for a child


def test_a_launcher_hands_its_lines_to_its_ranks_only():
    _log.new_run()
    _log.say_once("versions", "[liger_fsdp] said by the launcher")
    with _log.handed_on():
        assert os.environ[_log.SAID_ENV] == "versions"  # what torchrun's ranks inherit
    assert _log.SAID_ENV not in os.environ  # the launcher's own environment as it was


def test_second_v1_engage_holds_the_patches_until_the_last_disengages():
    pytest.importorskip("llamafactory.v1")
    from llamafactory.v1.core import base_trainer

    from llamafactory_liger_fsdp import _patch, engage
    from llamafactory_liger_fsdp.integration.v1 import engine as v1
    from llamafactory_liger_fsdp.testing import make_model, make_peft

    original = base_trainer.BaseTrainer.compute_log_probs
    v1._RUN["config"] = v1_args.config_of({"name": "liger_fsdp"})
    try:
        first, second = make_peft(make_model("llama"), "mts"), make_peft(make_model("llama"), "mts")
        v1.engage_v1(first)
        v1.engage_v1(second)
        assert engage.engaged(first) and engage.engaged(second)
        engage.disengage(first)
        assert getattr(base_trainer.BaseTrainer.compute_log_probs, _patch.MARK, False)  # the second still needs it
        engage.disengage(second)
        assert base_trainer.BaseTrainer.compute_log_probs is original
    finally:
        v1._RUN["config"] = None


def test_two_models_of_one_process_hold_the_default_engines_patches(base):
    """Two FSDP2 adapter models engaged in one process: the class / module patches stay until the last one disengages
    (the second engage used to get no undo and the first's disengage took them from under it)."""
    from accelerate.utils import fsdp_utils

    from llamafactory_liger_fsdp import _patch, engage
    from llamafactory_liger_fsdp.integration.llamafactory import engage_model
    from llamafactory_liger_fsdp.testing import make_model, make_peft

    fsdp2 = dict(fsdp="full_shard auto_wrap", fsdp_config=dict(version=2, transformer_layer_cls_to_wrap="LlamaDecoderLayer"))
    *_, finetuning_args, _ = train_args(dict(base, liger_fsdp=True, **fsdp2))
    cfg = config.get_config(finetuning_args)
    original = fsdp_utils.fsdp2_prepare_auto_wrap_policy
    models = [make_peft(make_model("llama"), "mts") for _ in range(2)]
    for model in models:
        assert engage_model(model, cfg, finetuning_args) is not None
    engage.disengage(models[0])
    assert getattr(fsdp_utils.fsdp2_prepare_auto_wrap_policy, _patch.MARK, False)
    engage.disengage(models[1])
    assert fsdp_utils.fsdp2_prepare_auto_wrap_policy is original


# -------------------------------------------------------------------------------- point 8: tested means CI's stacks
def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        name, eq, version = line.split("#")[0].strip().partition("==")
        if eq:
            pins[name] = version
    return pins


def test_the_tested_table_is_the_ci_stacks():
    pins = _pins()
    pinned = {name: pins[name] for name in versions.TESTED if name in pins}
    assert set(pinned) >= {"torch", "llamafactory"} and versions.untested(pinned) == []
    assert versions.TESTED["transformers"] == "5.8"  # git main's stack: the newest its pins allow
    assert versions.untested({"peft": "0.21.0", "accelerate": "1.15.0", "transformers": "5.17.0"}) == [
        "transformers 5.17.0 (tested up to 5.8)", "peft 0.21.0 (tested up to 0.18)", "accelerate 1.15.0 (tested up to 1.11)"]


def test_a_llamafactory_dev_release_after_the_snapshot_is_untested():
    import re
    import tarfile

    snapshot = sorted((ROOT.parent / "shared" / "llamafactory-main").glob("LLaMA-Factory-*.tar.gz"))
    if snapshot:  # the version CI's git main stack runs
        with tarfile.open(snapshot[0]) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("src/llamafactory/extras/env.py"))
            text = tar.extractfile(member).read().decode()
        assert versions.TESTED["llamafactory"] == re.search(r'VERSION = "([^"]+)"', text).group(1)
    top = versions.TESTED["llamafactory"]
    assert versions.untested({"llamafactory": top}) == []
    later = top.rsplit("dev", 1)[0] + f"dev{int(top.rsplit('dev', 1)[1]) + 1}"
    assert versions.untested({"llamafactory": later}) == [f"llamafactory {later} (tested up to {top})"]
    assert "guard compares" in versions.note(True, {"llamafactory": later})


# ---------------------------------------------------------------------------------------------- point 9: smaller
def test_doctor_help(capsys):
    assert doctor.main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m llamafactory_liger_fsdp doctor") and "LLaMA-Factory rejects" not in out


def test_doctor_sharding_under_accelerate_launch(assets, tmp_path, monkeypatch):
    from support.cli import base_yaml

    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "out", liger_fsdp=True)))
    ok, lines = doctor.check_yaml(str(path))
    text = "\n".join(lines)
    assert ok and "(from one process)" not in text and "under `accelerate launch` it is what the accelerate config" \
        in text, text
    accelerate = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp2.yaml").read_text())
    ok, lines = doctor.check_yaml(str(path), accelerate=accelerate)
    assert ok and "sharding: FSDP2 (from accelerate's FSDP config)." in lines, lines


def test_liger_kernels_without_cuda_refused_at_load_not_in_the_guard(monkeypatch):
    """`enable_liger_kernel` on a machine without a GPU: the cause is Liger's kernels, named before step 1 (whose
    guard would run them first), not the plugin's guard."""
    liger = pytest.importorskip("liger_kernel.transformers")
    import torch

    from llamafactory_liger_fsdp.integration.llamafactory import liger_needs_cuda
    from llamafactory_liger_fsdp.testing import make_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = make_model("llama")
    liger_needs_cuda(model)  # Liger's loss only (what LF_BENCH_LIGER_LOSS_ONLY leaves): nothing to refuse
    model.model.norm = liger.LigerRMSNorm(model.config.hidden_size)
    with pytest.raises(LigerFsdpConfigError) as err:
        liger_needs_cuda(model)
    names_key_and_fix(str(err.value), "enable_liger_kernel: true", "`enable_liger_kernel: false`")
    assert "LigerRMSNorm" in str(err.value) and "guard" not in str(err.value)


def test_v1_yaml_without_use_v1_gets_the_hint(monkeypatch):
    from llamafactory_liger_fsdp.integration.launch import precheck

    monkeypatch.delenv("USE_V1", raising=False)
    raw = v1_args.read_raw([_v1_recipe()])
    with pytest.raises(LigerFsdpConfigError) as err:
        precheck(raw)
    names_key_and_fix(str(err.value), "kernel_config.name: liger_fsdp", "USE_V1=1 llamafactory-cli train")


def test_default_engine_yaml_under_use_v1_is_told_so(base):
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.top_level_keys(dict(base, liger_fsdp=True))
    names_key_and_fix(str(err.value), "liger_fsdp`", "unset USE_V1")
    assert "default engine" in str(err.value) and "go inside" not in str(err.value)


# ------------------------------------------------------------------------------- v1 CP yamls that stop every rank
def _cp_yamls() -> list:
    """(id, yaml overrides, v1 command, the key the refusal names): each yaml stops every rank of the installed
    LLaMA-Factory with or without the plugin."""
    from llamafactory_liger_fsdp.integration.v1 import cp_args

    other = ({"dist_config": {"name": "fsdp2"}, "cp_size": 2, "cp_mode": "ulysses"} if cp_args.spelling() ==
             cp_args.DIST else {"dist_config": {"name": "fsdp2", "cp_size": 2, "cp_mode": "ulysses"}})
    flash = {"flash_attn": "flash_attention_2"}
    return [("the other spelling", {**other, **flash}, "sft", "cp_size: 2`"),
            ("no flash_attention_2", cp_args.as_yaml(2), "sft", "`flash_attn: sdpa`"),
            ("dpo without a v1 DPO", {**cp_args.as_yaml(2), **flash}, "dpo", "`llamafactory-cli dpo`")]


@pytest.mark.parametrize("case", range(3))
def test_cp_yamls_that_stop_every_rank_refused_before_any_rank(assets, tmp_path, monkeypatch, capsys, case):
    """The launcher's pre-check, every rank (get_args: the spelling before v1's parser, the rest after it) and doctor
    say the same message naming the key and the fix; doctor exits 1."""
    pytest.importorskip("llamafactory.v1")
    from llamafactory_liger_fsdp.integration.v1 import cp_args
    from llamafactory_liger_fsdp.integration.v1 import engine as v1

    name, overrides, command, key = _cp_yamls()[case]
    if command == "dpo":
        monkeypatch.setattr(cp_args, "has_v1_dpo", lambda: False)  # as 0.9.5 (git main has one)
    raw = yaml.safe_load(open(_v1_recipe()))
    raw.update(model=str(assets / "model"), **overrides)
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(LigerFsdpConfigError) as launcher:
        v1.precheck(command, [str(path)])
    text = str(launcher.value)
    assert key in text and "Fix:" in text, text
    if command == "sft":  # a rank: v1's own (hooked) get_args -- the spelling before its parser, the rest after
        from llamafactory.v1.config.arg_parser import get_args

        with pytest.raises(LigerFsdpConfigError) as rank:
            get_args(dict(raw))
    else:  # 0.9.5's ranks stop in its launcher before parsing: the launcher's (and a bare torchrun's) check is it
        with pytest.raises(LigerFsdpConfigError) as rank:
            v1_args.check(command, raw, v1_args.config_of(raw["kernel_config"]))
    assert str(rank.value) == text
    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    capsys.readouterr()
    assert doctor.main(["doctor", *([command] if command == "dpo" else []), str(path)]) == 1, name
    out = capsys.readouterr().out
    assert f"error: {text}" in out and "will engage" not in out, out
