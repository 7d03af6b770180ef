"""Build the tiny local model/tokenizer/dataset once (the same script the CPU recipe uses)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(out: Path, *extra: str) -> Path:
    out = Path(out)
    if not (out / "model" / "config.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "recipes" / "tiny_cpu" / "make_assets.py"), str(out), *extra],
            check=True, capture_output=True, text=True,
        )
    return out


SHIM = ROOT / "tests" / "cpu_fsdp_shim"


def base_yaml(assets: Path, out: Path, **overrides) -> dict:
    cfg = dict(
        model_name_or_path=str(assets / "model"),
        stage="sft",
        do_train=True,
        finetuning_type="lora",
        lora_target="all",
        lora_rank=4,
        additional_target="embed_tokens,lm_head",
        dataset="tiny_alpaca",
        dataset_dir=str(assets / "data"),
        template="llama3",
        cutoff_len=128,
        overwrite_cache=True,
        preprocessing_num_workers=1,
        output_dir=str(out),
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1.0e-3,
        max_steps=6,
        lr_scheduler_type="constant",
        report_to="none",
        seed=0,
        use_cpu=True,
    )
    cfg.update(overrides)
    return cfg


FSDP2 = dict(fsdp="full_shard auto_wrap", fsdp_config=dict(version=2, transformer_layer_cls_to_wrap="LlamaDecoderLayer"))
FSDP1 = dict(
    fsdp="full_shard auto_wrap",
    fsdp_config=dict(version=1, sync_module_states=False, use_orig_params=False, transformer_layer_cls_to_wrap="LlamaDecoderLayer"),
)


def run_cli(cfg: dict, nproc: int | None = None, fsdp1: bool = False, timeout: int = 600, extra_env: dict | None = None,
            module_train: bool = False):
    """`llamafactory-cli train cfg.yaml` (or `python -m llamafactory_liger_fsdp train cfg.yaml` with
    ``module_train``); returns (returncode, log text, per-step losses)."""
    import json

    import yaml

    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / (out.name + ".yaml")
    path.write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("ALLOW_EXTRA_ARGS", None)
    if nproc:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(nproc), FSDP_STATE_DICT_TYPE="FULL_STATE_DICT")
        env["PYTHONPATH"] = str(SHIM) + os.pathsep + env.get("PYTHONPATH", "")
        if fsdp1:
            env["CPU_FSDP_SHIM_SKIP_SAVE"] = "1"
    for key, value in (extra_env or {}).items():  # None removes a variable
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    command = [sys.executable, "-m", "llamafactory_liger_fsdp"] if module_train else [os.path.join(bindir, "llamafactory-cli")]
    proc = subprocess.run(
        [*command, "train", str(path)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=str(out.parent),
    )
    log = proc.stdout + proc.stderr
    return proc.returncode, log, [loss for _, loss in sorted(step_losses(out).items())]


def step_losses(out: Path) -> dict[int, float]:
    """{optimizer step: loss} from LLaMA-Factory's trainer_log.jsonl (a resumed run appends to it;
    the latest record of a step wins)."""
    import json

    log_file = Path(out) / "trainer_log.jsonl"
    losses = {}
    if log_file.exists():
        for rec in map(json.loads, log_file.read_text().splitlines()):
            if "loss" in rec:
                losses[int(rec["current_steps"])] = float(rec["loss"])
    return losses
