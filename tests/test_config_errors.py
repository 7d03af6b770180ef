"""The flag through LLaMA-Factory's own argument parser, and every refusal by its exact text."""

import json
import os
import sys

import pytest

from llamafactory_liger_fsdp import config, families, integration
from llamafactory_liger_fsdp.config import LigerFsdpConfigError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from e2e_assets import build

    return build(tmp_path_factory.mktemp("assets"))


@pytest.fixture
def base(assets, tmp_path):
    return dict(
        model_name_or_path=str(assets / "model"), stage="sft", do_train=True, finetuning_type="lora",
        dataset="tiny_alpaca", dataset_dir=str(assets / "data"), template="llama3", output_dir=str(tmp_path / "out"),
        report_to="none",
    )


def _train_args(args):
    from llamafactory.hparams import get_train_args

    return get_train_args(args)


def test_flag_accepted_without_allow_extra_args(base, monkeypatch):
    monkeypatch.delenv("ALLOW_EXTRA_ARGS", raising=False)
    *_, finetuning_args, _ = _train_args(dict(base, liger_fsdp=True, liger_fsdp_backend="torch"))
    assert config.get_config(finetuning_args) == config.LigerFsdpConfig(enabled=True, backend="torch")
    *_, finetuning_args, _ = _train_args(dict(base))
    assert config.get_config(finetuning_args).enabled is False


def test_other_unknown_keys_still_rejected(base):
    with pytest.raises(ValueError, match=r"Some keys are not used by the HfArgumentParser: \['not_a_key'\]"):
        _train_args(dict(base, liger_fsdp=True, not_a_key=1))


def test_yaml_and_cli_override(base, tmp_path, monkeypatch):
    """`llamafactory-cli train sft.yaml liger_fsdp=true` and the yaml key itself."""
    import yaml

    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(dict(base, liger_fsdp=False)))
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", str(path), "liger_fsdp=true"])
    *_, finetuning_args, _ = _train_args(None)
    assert config.get_config(finetuning_args).enabled is True


def test_argv_form(base):
    argv = [f"--{k}={v}" for k, v in base.items()] + ["--liger_fsdp", "true"]
    *_, finetuning_args, _ = _train_args(argv)
    assert config.get_config(finetuning_args).enabled is True
    argv = [f"--{k}={v}" for k, v in base.items()] + ["--liger_fsdp"]
    *_, finetuning_args, _ = _train_args(argv)
    assert config.get_config(finetuning_args).enabled is True


@pytest.mark.parametrize("value", ["yes", 1, "maybe", None])
def test_wrong_type(base, value):
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base, liger_fsdp=value))
    assert str(err.value) == (
        f"`liger_fsdp` must be true or false, got {value!r} ({type(value).__name__}). "
        "Fix: write `liger_fsdp: true` (or `false`) in the yaml, or `liger_fsdp=true` on the command line."
    )


def test_bad_backend(base):
    with pytest.raises(LigerFsdpConfigError, match=r"^`liger_fsdp_backend` must be one of auto, triton, triton_fast, torch, got 'cuda'"):
        _train_args(dict(base, liger_fsdp=True, liger_fsdp_backend="cuda"))


def test_unknown_plugin_key(base):
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base, liger_fsdp=True, liger_fsdp_chunk=4))
    assert str(err.value) == (
        "Unknown key(s) `liger_fsdp_chunk`. The liger_fsdp plugin knows: `liger_fsdp`, `liger_fsdp_backend`. "
        "Fix: correct the spelling or remove them."
    )


@pytest.mark.parametrize("stage", ["dpo", "kto", "ppo", "rm"])
def test_stage_needs_logits(base, stage):
    extra = {"pref_beta": 0.1} if stage in ("dpo", "kto") else {}
    if stage == "ppo":
        extra["reward_model"] = base["model_name_or_path"]
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base, liger_fsdp=True, stage=stage, **extra))
    assert str(err.value) == (
        f"`liger_fsdp: true` does not work with `stage: {stage}`: that stage needs the full logits, which the fused "
        "loss never builds. Supported stages: sft, pt. Fix: remove `liger_fsdp` for this run."
    )


def test_unsloth(base):
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base, liger_fsdp=True, use_unsloth=True))
    assert str(err.value).startswith("`liger_fsdp: true` does not work with `use_unsloth: true`")
    assert "Fix: set `use_unsloth: false` or remove `liger_fsdp`." in str(err.value)


def test_logit_losses(base):
    with pytest.raises(LigerFsdpConfigError, match=r"^`liger_fsdp: true` does not work with `use_dft_loss: true`"):
        _train_args(dict(base, liger_fsdp=True, use_dft_loss=True))


ZERO3_TEXT = (
    "`liger_fsdp: true` does not support DeepSpeed ZeRO-3 yet (`deepspeed:` config with `zero_optimization.stage: 3`). "
    "Fix: use FSDP (`fsdp: full_shard auto_wrap` or an accelerate FSDP config), or ZeRO-2, or remove `liger_fsdp`."
)


def test_zero3_accelerate_env(base, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    from types import SimpleNamespace

    with pytest.raises(LigerFsdpConfigError) as err:
        config.check_training_args(
            config.LigerFsdpConfig(enabled=True), SimpleNamespace(), SimpleNamespace(deepspeed=None), SimpleNamespace(stage="sft")
        )
    assert str(err.value) == ZERO3_TEXT


def test_zero3_config_file(tmp_path):
    """A ZeRO-3 json (LLaMA-Factory's examples/deepspeed/ds_z3_config.json shape); ZeRO-2 is fine."""
    from types import SimpleNamespace

    on = config.LigerFsdpConfig(enabled=True)
    for stage in (2, 3):
        path = tmp_path / f"ds{stage}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        args = (on, SimpleNamespace(), SimpleNamespace(deepspeed=str(path)), SimpleNamespace(stage="sft"))
        if stage == 3:
            with pytest.raises(LigerFsdpConfigError) as err:
                config.check_training_args(*args)
            assert str(err.value) == ZERO3_TEXT
        else:
            config.check_training_args(*args)


def test_unsupported_family(tmp_path):
    from transformers import GPT2Config
    from types import SimpleNamespace

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    import llamafactory.model.loader as loader

    with pytest.raises(LigerFsdpConfigError) as err:
        integration.check_before_load(loader, SimpleNamespace(
            model_name_or_path=str(tmp_path), trust_remote_code=False, cache_dir=None, model_revision="main",
            hf_hub_token=None, use_modelscope_hub=False, use_openmind_hub=False), add_valuehead=False)
    assert str(err.value) == (
        "`liger_fsdp: true` does not support model type `gpt2`. Supported model types: "
        + ", ".join(sorted(families.FAMILIES))
        + ". Fix: remove `liger_fsdp` for this model (or file an issue to add it)."
    )


def test_value_head():
    import llamafactory.model.loader as loader

    with pytest.raises(LigerFsdpConfigError, match="does not work with a value head"):
        integration.check_before_load(loader, None, add_valuehead=True)


def test_dora_head_refused():
    from peft import LoraConfig, get_peft_model

    from llamafactory_liger_fsdp import head
    from tiny import make_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"], use_dora=True))
    with pytest.raises(LigerFsdpConfigError, match=r"supports plain LoRA on lm_head; this head uses DoRA"):
        head.engage(model)
