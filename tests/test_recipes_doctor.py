"""Every recipe parses as copied with both launchers it documents (torchrun through `llamafactory-cli`, and
`accelerate launch` with its accelerate config), and `doctor` decides with the training code, also for a GPU
recipe on this GPU-less machine."""

import glob
import json
import os
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")) + glob.glob(os.path.join(ROOT, "recipes", "*", "sft.yaml")))
GPU_RECIPES = [p for p in RECIPES if "tiny_cpu" not in p]
ACCELERATE_RECIPES = [p for p in GPU_RECIPES if "accelerate launch --config_file" in open(p).read()]


def _accelerate_env(accelerate_config: str, recipe: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file C -m llamafactory.launcher R` gives its workers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", accelerate_config, "-m", "llamafactory.launcher", recipe])
    args, _, _ = _validate_launch_command(args)
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def test_there_are_recipes():
    names = {os.path.relpath(p, ROOT) for p in RECIPES}
    assert {"recipes/llama3_8b_lora_fsdp1.yaml", "recipes/llama3_8b_lora_fsdp2.yaml", "recipes/qwen2_5_7b_lora_fsdp1.yaml",
            "recipes/qwen2_5_7b_lora_fsdp2.yaml", "recipes/llama3_8b_lora_head_fsdp2.yaml", "recipes/tiny_cpu/sft.yaml",
            "recipes/qwen2_5_7b_lora_zero3.yaml", "recipes/qwen2_5_7b_lora_dpo_fsdp2.yaml"} <= names


def _parse(path, monkeypatch, env=None):
    from llamafactory.hparams import get_train_args

    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ALLOW_EXTRA_ARGS", raising=False)
    # CI has no GPU and transformers refuses `bf16: true` there unless told to run on the CPU:
    # the only override, given the way a user would (a CLI override after the yaml).
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", path, "use_cpu=true"])
    return get_train_args()


TORCHRUN_ONLY = [p for p in RECIPES if "deepspeed:" in open(p).read()]  # LLaMA-Factory parses DeepSpeed in a rank only


@pytest.mark.parametrize("path", TORCHRUN_ONLY, ids=lambda p: os.path.relpath(p, ROOT))
def test_deepspeed_recipe_parses_in_a_rank(path):
    """As `FORCE_TORCHRUN=1 llamafactory-cli train` parses it: inside a torchrun worker (one, gloo, on the CPU)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(ROOT, "tests", "support", "parse_in_rank.py")
    from support.dist import free_port

    port = str(free_port())  # torchrun's default 29500 may be taken by a test running beside this one
    proc = subprocess.run([torchrun, "--nproc-per-node", "1", "--master-port", port, script, path, "use_cpu=true"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("PARSED ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    parsed = json.loads(line[len("PARSED "):])
    assert parsed == {"enabled": True, "sharding": "DeepSpeed ZeRO-3", "stage": "sft"}, parsed


@pytest.mark.parametrize("path", [p for p in RECIPES if p not in TORCHRUN_ONLY], ids=lambda p: os.path.relpath(p, ROOT))
def test_recipe_parses_with_torchrun(path, monkeypatch):
    from llamafactory_liger_fsdp import config

    text = open(path).read()
    assert "llamafactory-cli train recipes/" in text  # the launch command is stated
    assert "trust_remote_code" not in text  # Llama and Qwen2 are native in transformers
    cfg = yaml.safe_load(text)
    *_, finetuning_args, _ = _parse(path, monkeypatch)
    plugin = config.get_config(finetuning_args)
    assert plugin.enabled is True and finetuning_args.stage == cfg["stage"]
    if cfg.get("fsdp"):
        assert plugin.sharding.fsdp_version == cfg["fsdp_config"]["version"]



@pytest.mark.parametrize("path", ACCELERATE_RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_recipe_parses_with_accelerate_launch(path, monkeypatch):
    """The launch line the recipe states, as accelerate would run it: same yaml, same decisions."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from llamafactory_liger_fsdp import config

    text = open(path).read()
    line = next(l for l in text.splitlines() if "accelerate launch --config_file" in l)
    accelerate_config = os.path.join(ROOT, line.split("--config_file", 1)[1].split()[0])
    env = _accelerate_env(accelerate_config, path)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    _, _, training_args, finetuning_args, _ = _parse(path, monkeypatch, env)
    plugin = config.get_config(finetuning_args)
    version = int(env["FSDP_VERSION"])
    assert plugin.sharding.fsdp_version == version == yaml.safe_load(text)["fsdp_config"]["version"]
    # what the Trainer then builds: the yaml's FSDP keys and the accelerate config agree
    # (sync_module_states, which cpu_ram_efficient_loading implies, looks up a GPU; there is none here)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    fsdp_plugin = FullyShardedDataParallelPlugin(**dict(training_args.fsdp_plugin_args, sync_module_states=False))
    assert fsdp_plugin.fsdp_version == version
    assert "FULL_STATE_DICT" in str(fsdp_plugin.state_dict_type)


@pytest.mark.parametrize("name", ["fsdp1.yaml", "fsdp2.yaml"])
def test_accelerate_configs(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(os.path.join(ROOT, "recipes", "accelerate", name))
    assert cfg.distributed_type == "FSDP"
    assert int(cfg.fsdp_config["fsdp_version"]) == int(name[4])


def _doctor_here(monkeypatch, capsys, *args, **env):
    """`python -m llamafactory_liger_fsdp doctor ARGS` in this process (LLaMA-Factory is imported once for all):
    (exit status, stdout). The environment as the command line would have it."""
    from llamafactory_liger_fsdp import doctor

    for key, value in dict(LLAMAFACTORY_VERBOSITY="WARN", HF_HUB_OFFLINE="1", **env).items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    rc = doctor.main(["doctor", *args])
    return rc, capsys.readouterr().out


def _doctor(*args, **env):
    full_env = dict(os.environ, LLAMAFACTORY_VERBOSITY="WARN", HF_HUB_OFFLINE="1", **env)
    proc = subprocess.run([sys.executable, "-m", "llamafactory_liger_fsdp", "doctor", *args], capture_output=True,
                          text=True, env=full_env, timeout=300)
    return proc.returncode, proc.stdout


def test_doctor_versions_and_hook():
    rc, out = _doctor()
    assert rc == 0, out
    for name in ("torch", "triton", "transformers", "peft", "accelerate", "llamafactory"):
        assert f"  {name} " in out
    assert "import hook: active" in out


def test_hook_check_tells_whether_the_pth_ran():
    """An install the .pth never reaches (`pip install --target`, a package on PYTHONPATH): the package imports, but
    `llamafactory-cli train` would reject `liger_fsdp`. The check must not install the hook by importing it."""
    from llamafactory_liger_fsdp import doctor

    assert doctor.hook_status()[0] is True
    no_site = dict(os.environ, PYTHONPATH=ROOT)  # -S: no site-packages, no .pth; the package still importable
    assert doctor.hook_status([sys.executable, "-S"], no_site)[0] is False
    assert doctor.hook_status(env=dict(os.environ, LLAMAFACTORY_LIGER_FSDP_PTH="0"))[0] is False
    activated = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "llamafactory_liger_fsdp", "_activate") + os.pathsep + ROOT)
    assert doctor.hook_status([sys.executable, "-S"], activated)[0] is False  # -S skips sitecustomize too
    assert doctor.hook_status(env=dict(activated, LLAMAFACTORY_LIGER_FSDP_PTH="0"))[0] is True  # `... train`'s way


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_doctor_would_train_every_recipe_offline(path, monkeypatch):
    """Hub model ids cannot be read here: the decision still comes from the yaml (head kind, sharding), the machine's
    complaints on their own line, and it would train (exit 0) -- DeepSpeed recipes included, with FORCE_TORCHRUN
    set or not. In process (`doctor.check_yaml`, what `main` prints and turns into the exit status)."""
    from llamafactory_liger_fsdp import doctor

    monkeypatch.chdir(ROOT)  # the recipes name recipes/deepspeed/*.json relative to the repository
    for torchrun in ([False, True] if "deepspeed:" in open(path).read() else [False]):
        if torchrun:
            monkeypatch.setenv("FORCE_TORCHRUN", "1")
        ok, lines = doctor.check_yaml(path)
        out = "\n".join(lines)
        assert ok, out
        assert "could not read the model's config here" in out and "will engage: head=" in out, out
        assert "decided from the yaml alone" in out and "sharding: " in out
        if "deepspeed:" in open(path).read():
            assert "sharding: DeepSpeed ZeRO-3" in out and "this machine: LLaMA-Factory would reject" in out


@pytest.fixture(scope="module")
def qwen7b_config(tmp_path_factory):
    """Qwen2.5-7B's real config (no weights): the doctor builds that model on the meta device."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("qwen2_5_7b")
    Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False).save_pretrained(path)
    return str(path)


def test_doctor_gpu_recipe_on_this_cpu_machine(qwen7b_config, monkeypatch, capsys):
    recipe = os.path.join(ROOT, "recipes", "qwen2_5_7b_lora_fsdp2.yaml")
    rc, out = _doctor_here(monkeypatch, capsys, recipe, f"model_name_or_path={qwen7b_config}")
    assert rc == 0, out
    assert "this machine: LLaMA-Factory would reject the yaml here (Your setup doesn't support bf16/gpu" in out
    assert "sharding: FSDP2 (from the yaml's `fsdp:` keys)" in out
    assert "model type qwen2." in out
    assert "will engage: head=modules_to_save (lm_head)" in out
    assert "[liger_fsdp]" not in out  # a clean report, not interleaved with training-time lines


def _yaml(tmp_path, name, assets, **kw):
    from support.cli import base_yaml

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / name, **kw)))
    return str(path)


def test_doctor_decides_like_training(assets, tmp_path, monkeypatch, capsys):
    rc, out = _doctor_here(monkeypatch, capsys, _yaml(tmp_path, "frozen", assets, liger_fsdp=True, additional_target=None))
    assert rc == 0 and "not engaged: lm_head is frozen" in out, out  # trains: exit 0
    rc, out = _doctor_here(monkeypatch, capsys, _yaml(tmp_path, "off", assets))
    assert rc == 0 and "plugin off" in out, out
    rc, out = _doctor_here(monkeypatch, capsys, _yaml(tmp_path, "dora", assets, liger_fsdp=True, additional_target=None,
                            lora_target="q_proj,lm_head", use_dora=True))
    assert rc == 1 and "error: `liger_fsdp: true` supports plain LoRA on the head; `use_dora: true`" in out, out
    rc, out = _doctor_here(monkeypatch, capsys, _yaml(tmp_path, "triton", assets, liger_fsdp=True, liger_fsdp_backend="triton"),
                      TRITON_INTERPRET="0")
    assert rc == 0 and "this machine: `liger_fsdp_backend: triton` needs a CUDA GPU" in out, out
    rc, out = _doctor_here(monkeypatch, capsys, _yaml(tmp_path, "rm", assets, liger_fsdp=True, stage="rm"))
    assert rc == 1 and "error: `liger_fsdp: true` does not work with `stage: rm`" in out, out


def test_doctor_says_when_the_hook_is_inactive(assets, tmp_path, monkeypatch, capsys):
    rc, out = _doctor_here(monkeypatch, capsys, _yaml(tmp_path, "on", assets, liger_fsdp=True), LLAMAFACTORY_LIGER_FSDP_PTH="0")
    assert rc == 1, out
    assert "import hook: NOT active" in out and "python -m llamafactory_liger_fsdp train" in out
    assert "will engage: head=modules_to_save (lm_head)" in out  # still evaluated
