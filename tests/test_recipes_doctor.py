"""Every recipe parses with LLaMA-Factory's own argument parser (plugin installed), states its
launch commands, and `doctor` says whether it will engage and why."""

import glob
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")) + glob.glob(os.path.join(ROOT, "recipes", "*", "sft.yaml")))


def test_there_are_recipes():
    names = {os.path.relpath(p, ROOT) for p in RECIPES}
    assert {"recipes/llama3_8b_lora_fsdp1.yaml", "recipes/llama3_8b_lora_fsdp2.yaml", "recipes/qwen2_5_7b_lora_fsdp1.yaml",
            "recipes/qwen2_5_7b_lora_fsdp2.yaml", "recipes/llama3_8b_lora_head_fsdp2.yaml", "recipes/tiny_cpu/sft.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_recipe_parses(path, monkeypatch):
    from llamafactory.hparams import get_train_args

    from llamafactory_liger_fsdp import config

    text = open(path).read()
    assert "llamafactory-cli train recipes/" in text  # the launch command is stated
    if "tiny_cpu" not in path:
        assert "accelerate launch --config_file recipes/accelerate/fsdp" in text
    cfg = yaml.safe_load(text)
    monkeypatch.delenv("ALLOW_EXTRA_ARGS", raising=False)
    # CI has no GPU and transformers refuses `bf16: true` there unless told to run on the CPU:
    # the only override, given the way a user would (a CLI override after the yaml).
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", path, "use_cpu=true"])
    model_args, data_args, training_args, finetuning_args, _ = get_train_args()
    assert config.get_config(finetuning_args).enabled is True
    assert finetuning_args.stage == "sft"
    if cfg.get("fsdp"):
        assert int(training_args.fsdp_config["version"]) == cfg["fsdp_config"]["version"]


@pytest.mark.parametrize("name", ["fsdp1.yaml", "fsdp2.yaml"])
def test_accelerate_configs(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(os.path.join(ROOT, "recipes", "accelerate", name))
    assert cfg.distributed_type == "FSDP"
    assert int(cfg.fsdp_config["fsdp_version"]) == int(name[4])


def _doctor(*args):
    env = dict(os.environ, LLAMAFACTORY_VERBOSITY="WARN")
    proc = subprocess.run([sys.executable, "-m", "llamafactory_liger_fsdp", "doctor", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    return proc.returncode, proc.stdout


def test_doctor_versions_and_hook():
    rc, out = _doctor()
    assert rc == 0, out
    for name in ("torch", "triton", "transformers", "peft", "accelerate", "llamafactory"):
        assert f"  {name} " in out
    assert "import hook: active" in out


def test_doctor_will_engage(tmp_path):
    from e2e_assets import FSDP2, base_yaml, build

    assets = build(tmp_path / "assets")
    on = tmp_path / "on.yaml"
    on.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "o1", liger_fsdp=True)))
    rc, out = _doctor(str(on))
    assert rc == 0, out
    assert "will engage: head=modules_to_save" in out and "model type llama: supported" in out
    fsdp2 = tmp_path / "fsdp2.yaml"
    fsdp2.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "o5", liger_fsdp=True, **FSDP2)))
    rc, out = _doctor(str(fsdp2))
    assert rc == 0, out
    assert "fsdp=FSDP2" in out
    assert "checkpoints: state dict FULL_STATE_DICT; adapter checkpoints hold full tensors and resume on every rank." in out
    frozen = tmp_path / "frozen.yaml"
    frozen.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "o2", liger_fsdp=True, additional_target=None)))
    rc, out = _doctor(str(frozen))
    assert rc == 1 and "not engaged: lm_head stays frozen" in out
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "o3")))
    rc, out = _doctor(str(off))
    assert rc == 1 and "`liger_fsdp` is not set to true" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "o4", liger_fsdp=True, stage="dpo")))
    rc, out = _doctor(str(bad))
    assert rc == 1 and "does not work with `stage: dpo`" in out
