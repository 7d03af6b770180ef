"""The flag through LLaMA-Factory's own argument parser, the decided sharding, and every refusal: each names
its key and a fix."""

import json
import os
import sys
from types import SimpleNamespace

import pytest

from llamafactory_liger_fsdp import config, refusals, sharding
from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from support import names_key_and_fix, sft_args, train_args


@pytest.fixture
def base(assets, tmp_path):
    return sft_args(assets, tmp_path)


def test_flag_accepted_without_allow_extra_args(base, monkeypatch):
    monkeypatch.delenv("ALLOW_EXTRA_ARGS", raising=False)
    *_, finetuning_args, _ = train_args(dict(base, liger_fsdp=True, liger_fsdp_backend="torch"))
    cfg = config.get_config(finetuning_args)
    assert (cfg.enabled, cfg.backend, cfg.memory_report, cfg.checkpoint_repair) == (True, "torch", False, True)
    assert cfg.sharding == sharding.Sharding("none", source="one process")  # decided once, at parse time
    *_, finetuning_args, _ = train_args(dict(base))
    assert config.get_config(finetuning_args).enabled is False


def test_other_unknown_keys_still_rejected(base):
    with pytest.raises(ValueError, match=r"Some keys are not used by the HfArgumentParser: \['not_a_key'\]"):
        train_args(dict(base, liger_fsdp=True, not_a_key=1))


def test_yaml_and_cli_override(base, tmp_path, monkeypatch):
    """`llamafactory-cli train sft.yaml liger_fsdp=true` and the yaml key itself."""
    import yaml

    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(dict(base, liger_fsdp=False)))
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", str(path), "liger_fsdp=true", "liger_fsdp_memory_report=true"])
    *_, finetuning_args, _ = train_args(None)
    cfg = config.get_config(finetuning_args)
    assert cfg.enabled is True and cfg.memory_report is True


def test_argv_form(base):
    argv = [f"--{k}={v}" for k, v in base.items()] + ["--liger_fsdp", "true"]
    *_, finetuning_args, _ = train_args(argv)
    assert config.get_config(finetuning_args).enabled is True
    argv = [f"--{k}={v}" for k, v in base.items()] + ["--liger_fsdp"]
    *_, finetuning_args, _ = train_args(argv)
    assert config.get_config(finetuning_args).enabled is True


@pytest.mark.parametrize("key,value", [("liger_fsdp", "yes"), ("liger_fsdp", 1), ("liger_fsdp", None),
                                       ("liger_fsdp_memory_report", "maybe"), ("liger_fsdp_backend", "cuda")])
def test_wrong_value(base, key, value):
    extra = {} if key == "liger_fsdp" else {"liger_fsdp": True}
    with pytest.raises(LigerFsdpConfigError) as err:
        train_args(dict(base, **extra, **{key: value}))
    names_key_and_fix(str(err.value), key, key)
    assert repr(value) in str(err.value)


def test_unknown_plugin_key(base):
    with pytest.raises(LigerFsdpConfigError) as err:
        train_args(dict(base, liger_fsdp=True, liger_fsdp_chunk=4))
    names_key_and_fix(str(err.value), "liger_fsdp_chunk", "spelling")
    assert "`liger_fsdp_backend`" in str(err.value)  # says which keys exist


def test_plugin_key_without_the_flag(base):
    with pytest.raises(LigerFsdpConfigError) as err:
        train_args(dict(base, liger_fsdp_backend="triton"))
    names_key_and_fix(str(err.value), "liger_fsdp_backend", "liger_fsdp: true")


@pytest.mark.parametrize("stage", ["ppo", "rm"])
def test_stage_refused(base, stage):
    extra = {"reward_model": base["model_name_or_path"]} if stage == "ppo" else {}
    with pytest.raises(LigerFsdpConfigError) as err:
        train_args(dict(base, liger_fsdp=True, stage=stage, **extra))
    names_key_and_fix(str(err.value), f"stage: {stage}", "liger_fsdp", f"stage: {stage}")
    assert "value head" in str(err.value)  # the reason, not just "unsupported"


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_preference_stages_accepted(base, stage):
    *_, finetuning_args, _ = train_args(dict(base, liger_fsdp=True, stage=stage, pref_beta=0.1))
    assert config.get_config(finetuning_args).enabled and finetuning_args.stage == stage


@pytest.mark.parametrize("key", ["use_unsloth", "use_dft_loss"])
def test_settings_that_replace_the_loss(base, key):
    with pytest.raises(LigerFsdpConfigError) as err:
        train_args(dict(base, liger_fsdp=True, **{key: True}))
    names_key_and_fix(str(err.value), f"{key}: true", f"{key}: false")


@pytest.mark.parametrize("bad,key", [
    (dict(stage="rm"), "stage: rm"), (dict(liger_fsdp_backend="cuda"), "liger_fsdp_backend"),
    (dict(lora_target="q_proj,lm_head", use_dora=True), "use_dora: true"), (dict(use_unsloth=True), "use_unsloth"),
    (dict(liger_fsdp_gaurd=False), "liger_fsdp_gaurd")])
def test_launcher_precheck_refuses(base, bad, key):
    """The function the patched `llamafactory-cli train` runs before any rank starts, on the raw yaml (one launch of
    it end to end: test_e2e_cli.py::test_refused_once_before_any_rank_starts)."""
    from llamafactory_liger_fsdp.integration.launch import precheck

    with pytest.raises(LigerFsdpConfigError) as err:
        precheck(dict(base, liger_fsdp=True, **bad))
    assert f"`{key}" in str(err.value) and "Fix" in str(err.value), str(err.value)


def test_raw_and_parsed_refusals_are_one_text(base):
    """The launching process (raw yaml) and every rank (parsed arguments) refuse with the same text."""
    with pytest.raises(LigerFsdpConfigError) as parsed:
        train_args(dict(base, liger_fsdp=True, stage="rm"))
    with pytest.raises(LigerFsdpConfigError) as raw:
        refusals.check_raw(dict(base, stage="rm"))
    assert str(raw.value) == str(parsed.value)
    with pytest.raises(LigerFsdpConfigError, match="use_unsloth"):
        refusals.check_raw(["--stage", "sft", "--use_unsloth"])  # the argv form too


def _ds(tmp_path, stage, **zero):
    path = tmp_path / f"ds{stage}.json"
    path.write_text(json.dumps({"zero_optimization": dict(stage=stage, **zero)}))
    return str(path)


def test_sharding_decided_from_every_source(tmp_path):
    ns = SimpleNamespace
    assert sharding.decide(ns(fsdp=["full_shard", "auto_wrap"], fsdp_config={"version": 2}), {}).kind == "fsdp2"
    assert sharding.decide(ns(fsdp="full_shard auto_wrap", fsdp_config={}), {}).kind == "fsdp1"
    assert sharding.decide(ns(), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}).kind == "fsdp2"
    z3 = sharding.decide(ns(deepspeed=_ds(tmp_path, 3, offload_param={"device": "cpu"})), {})
    assert (z3.kind, z3.zero_stage, z3.offload_param, z3.label) == ("deepspeed", 3, "cpu", "DeepSpeed ZeRO-3 (param offload cpu)")
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    assert sharding.decide(ns(), env).label == "DeepSpeed ZeRO-2"
    assert sharding.decide(ns(), {"WORLD_SIZE": "2"}).kind == "ddp"
    assert sharding.decide(ns(), {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}).kind == "ddp"
    assert sharding.decide(ns(), {}).kind == "none"


def test_every_zero_stage_accepted(tmp_path, base):
    """DeepSpeed ZeRO-0..3 (a `deepspeed:` json or accelerate's env) pass the refusals: the loss is gathered by
    DeepSpeed's own module hooks (tests/test_ds_parity.py)."""
    for stage in range(4):
        refusals.check_raw(base, sharding.decide(SimpleNamespace(deepspeed=_ds(tmp_path, stage)), {}))
    refusals.check_raw(base, sharding.decide(SimpleNamespace(), {"ACCELERATE_USE_DEEPSPEED": "true",
                                                                 "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}))


def test_unsupported_family(tmp_path):
    from transformers import GPT2Config

    from llamafactory_liger_fsdp.integration.llamafactory import check_family

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(LigerFsdpConfigError) as err:
        check_family(SimpleNamespace(model_name_or_path=str(tmp_path)))
    names_key_and_fix(str(err.value), "liger_fsdp: true", "liger_fsdp")
    assert "`gpt2`" in str(err.value) and "llama" in str(err.value)


def test_dora_head_refused():
    from peft import LoraConfig, get_peft_model

    from llamafactory_liger_fsdp.engage import engage
    from llamafactory_liger_fsdp.testing import make_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"], use_dora=True))
    with pytest.raises(LigerFsdpConfigError) as err:
        engage(model)
    names_key_and_fix(str(err.value), "liger_fsdp: true", "plain LoRA")
    assert "DoRA" in str(err.value)


def test_disable_env_accepts_and_ignores_the_keys(base, monkeypatch, capsys):
    from llamafactory_liger_fsdp import _log

    monkeypatch.setenv(config.DISABLE_ENV, "1")
    said = f"[liger_fsdp] {config.DISABLE_ENV}=1: the liger_fsdp keys are accepted and ignored"
    *_, finetuning_args, _ = train_args(dict(base, liger_fsdp=True, liger_fsdp_backend="nonsense"))
    assert config.get_config(finetuning_args).enabled is False
    train_args(dict(base, liger_fsdp=True))  # a second run in this process says it again
    assert capsys.readouterr().err.count(said) == 2
    monkeypatch.setenv(_log.SAID_ENV, "disabled")  # a rank whose launcher said it: not again
    train_args(dict(base, liger_fsdp=True))
    assert capsys.readouterr().err.count(said) == 0 and _log.SAID_ENV not in os.environ  # taken, not handed on


def test_disabled_plugin_still_catches_misspelled_keys(base, monkeypatch):
    monkeypatch.setenv(config.DISABLE_ENV, "1")
    with pytest.raises(LigerFsdpConfigError) as err:
        train_args(dict(base, liger_fsdp=True, liger_fsdp_gaurd=False))
    names_key_and_fix(str(err.value), "liger_fsdp_gaurd", "spelling")


@pytest.mark.parametrize("extra,key", [(dict(lora_target="q_proj,lm_head", use_dora=True), "use_dora: true"),
                                       (dict(finetuning_type="oft", oft_target="q_proj,lm_head"), "oft_target")])
def test_head_variant_refused_from_the_yaml(base, extra, key):
    """DoRA / OFT on the head: decided by the yaml, so refused before any rank starts (raw) with the parsed text."""
    with pytest.raises(LigerFsdpConfigError) as raw:
        refusals.check_raw(dict(base, **extra))
    names_key_and_fix(str(raw.value), key, "lm_head", "additional_target")
    with pytest.raises(LigerFsdpConfigError) as parsed:
        train_args(dict(base, liger_fsdp=True, **extra))
    assert str(parsed.value) == str(raw.value)
    refusals.check_raw(dict(base, lora_target="q_proj,v_proj", use_dora=True))  # DoRA elsewhere is fine


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
def test_triton_backend_needs_cuda(base, monkeypatch, backend):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' own interpreter switch
    cfg = config.from_mapping({"liger_fsdp": True, "liger_fsdp_backend": backend})
    with pytest.raises(LigerFsdpConfigError) as err:
        refusals.check_raw(base, None, cfg)
    names_key_and_fix(str(err.value), f"liger_fsdp_backend: {backend}", "liger_fsdp_backend: auto")
    with refusals.for_another_machine():  # doctor on a login node reports it apart
        refusals.check_raw(base, None, cfg)


def test_version_policy_older_refused_newer_named_broken_refused(base, monkeypatch, capsys):
    from llamafactory_liger_fsdp import versions

    assert versions.too_old() == []  # the stack the tests run on works
    stack = {"torch": "2.15.0+cu130", "triton": "3.9.0", "transformers": "5.8.0", "peft": "0.18.1",
             "accelerate": "1.11.0", "llamafactory": "0.9.6.dev0"}  # CI's PyPI stack / LLaMA-Factory git main
    assert versions.too_old(stack) == [] and versions.untested(stack) == []
    assert versions.too_old({"torch": "2.9.1", "transformers": "4.57.1"}) == [
        "torch 2.9.1 (needs >= 2.11)", "transformers 4.57.1 (needs >= 5.6)"]
    assert versions.upgrade_command({"torch": "2.9.1", "transformers": "4.57.1"}) == \
        "pip install 'torch>=2.11' 'transformers>=5.6'" and versions.upgrade_command(stack) is None
    assert versions.untested({"torch": "2.16.0", "triton": "3.9.1", "llamafactory": "0.9.6",
                              "transformers": "5.8.9"}) == [
        "torch 2.16.0 (tested up to 2.15)", "llamafactory 0.9.6 (tested up to 0.9.6.dev0)"]

    # older: one refusal naming the versions and the upgrade
    monkeypatch.setattr(versions, "installed", lambda name: {"torch": "2.10.0", "peft": "0.17.1"}.get(name))
    with pytest.raises(LigerFsdpConfigError) as err:
        refusals.check_raw(base, None, config.from_mapping({"liger_fsdp": True}))
    names_key_and_fix(str(err.value), "liger_fsdp: true", "pip install 'torch>=2.11' 'peft>=0.18'")
    assert "torch 2.10.0 (needs >= 2.11), peft 0.17.1 (needs >= 0.18)" in str(err.value)

    # newer: trains, one line naming them (guard on or off)
    monkeypatch.setattr(versions, "installed", lambda name: {"transformers": "5.30.0"}.get(name))
    refusals.check_raw(base, None, config.from_mapping({"liger_fsdp": True}))
    assert versions.note(True) == (
        "[liger_fsdp] untested versions: transformers 5.30.0 (tested up to 5.8); training as usual, the first-step "
        "guard compares the fused loss with the model's own forward and stops the run if they differ.")
    assert "`liger_fsdp_guard: false`: nothing checks" in versions.note(False)

    # known broken: refused with the reason where it applies (the Triton interpreter), not elsewhere
    monkeypatch.setattr(versions, "installed", lambda name: {"triton": "3.6.0", "numpy": "2.4.6"}.get(name))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(LigerFsdpConfigError) as err:
        refusals.check_raw(base, None, config.from_mapping({"liger_fsdp": True, "liger_fsdp_backend": "triton"}))
    names_key_and_fix(str(err.value), "liger_fsdp_backend: triton", "numpy<2.4")
    assert "triton 3.6.0, numpy 2.4.6" in str(err.value)
    refusals.check_raw(base, None, config.from_mapping({"liger_fsdp": True}))  # auto on the CPU: the torch kernel


def test_the_old_override_key_still_parses(base):
    cfg = config.from_mapping({"liger_fsdp": True, "liger_fsdp_allow_untested_versions": True})
    refusals.check_raw(base, None, cfg)
    assert "no longer needed" in config.KEYS["liger_fsdp_allow_untested_versions"]


def test_pyproject_never_pins_the_users_stack():
    """Installing the plugin must not move llamafactory, torch, triton, transformers, peft or accelerate: no ranges;
    what is too old is refused at run time (versions.MINIMUM), with the fix."""
    import tomllib

    from llamafactory_liger_fsdp import versions

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert all(dep.isidentifier() or dep.replace("-", "_").isidentifier() for dep in deps), deps
    assert set(versions.MINIMUM) - {"triton"} <= set(deps)


def test_keys_take_their_defaults_from_the_dataclass():
    """One home for the defaults: an unset key keeps the field's default, and help text that states a default states
    that one."""
    import dataclasses
    import re

    defaults = {f.name: f.default for f in dataclasses.fields(config.LigerFsdpConfig)}
    assert config.from_mapping({"liger_fsdp": True}) == config.LigerFsdpConfig(enabled=True)
    assert set(config.FIELDS) <= set(config.KEYS) and set(config.FIELDS.values()) <= set(defaults)
    for key, name in config.FIELDS.items():
        stated = re.search(r"\(default (\w+)\)", config.KEYS[key])
        assert stated is None or stated.group(1) == str(defaults[name]).lower(), key


def test_one_reader_of_the_command_line(tmp_path):
    """The parser's split and the refusals read a command line the same way (args.argv_values)."""
    from llamafactory_liger_fsdp.args import true_or_false, truthy

    argv = ["--stage", "sft", "--liger_fsdp", "--liger_fsdp_backend=torch", "--use_dora", "--lora_target", "lm_head"]
    rest, ours = config.split(argv)
    assert rest == ["--stage", "sft", "--use_dora", "--lora_target", "lm_head"]
    assert ours == {"liger_fsdp": "true", "liger_fsdp_backend": "torch"}
    with pytest.raises(LigerFsdpConfigError, match="DoRA"):
        refusals.check_raw(rest)
    assert [true_or_false(v) for v in (True, " False ", "yes", 1)] == [True, False, None, None]
    assert [truthy(v) for v in ("1", "ON", True, "0", "", None)] == [True, True, True, False, False, False]
