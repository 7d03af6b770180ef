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


SHIM = ROOT / "llamafactory_liger_fsdp" / "testing" / "cpu_fsdp_shim"


def base_yaml(assets: Path, out: Path, **overrides) -> dict:
    """The tiny run's yaml; an override of None removes the key."""
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
    return {k: v for k, v in cfg.items() if v is not None}


def deepspeed(out_dir: Path, stage: int, offload: str = "none") -> dict:
    """Yaml keys for DeepSpeed ZeRO-``stage`` on CPU ranks: a json like LLaMA-Factory's examples/deepspeed ones.
    DeepSpeed picks gloo and its CPU accelerator by itself; ``use_cpu`` must be off (with it DeepSpeed counts
    world size 1 and fails its batch-size check)."""
    import json

    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    for what in ("param", "optimizer"):
        if offload in (what, "both"):
            zero[f"offload_{what}"] = {"device": "cpu"}
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {"enabled": "auto"},
              "fp16": {"enabled": "auto"}, "zero_optimization": zero}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"ds_z{stage}_{offload}.json"
    path.write_text(json.dumps(config))
    return dict(deepspeed=str(path), use_cpu=None)


FSDP2 = dict(fsdp="full_shard auto_wrap", fsdp_config=dict(version=2, transformer_layer_cls_to_wrap="LlamaDecoderLayer"))
FSDP1 = dict(
    fsdp="full_shard auto_wrap",
    fsdp_config=dict(version=1, sync_module_states=False, use_orig_params=False, transformer_layer_cls_to_wrap="LlamaDecoderLayer"),
)


def run_cli(cfg: dict, nproc: int | None = None, fsdp1: bool = False, timeout: int = 600, extra_env: dict | None = None,
            module_train: bool = False, shim: bool = True):
    """`llamafactory-cli train cfg.yaml` (or `python -m llamafactory_liger_fsdp train cfg.yaml` with
    ``module_train``); returns (returncode, log text, per-step losses). ``shim``: with ``nproc``, put the test-only
    CPU FSDP shim (a sitecustomize) on the workers' path."""

    import yaml

    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / (out.name + ".yaml")
    path.write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("ALLOW_EXTRA_ARGS", None)
    env.pop("LLAMAFACTORY_LIGER_FSDP_SAID_DISABLED", None)  # a launcher's note to its ranks, never inherited here
    if nproc:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(nproc), FSDP_STATE_DICT_TYPE="FULL_STATE_DICT")
        if cfg.get("deepspeed"):
            env["CUDA_VISIBLE_DEVICES"] = ""
        if shim:
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


def assert_same_losses(losses: list[float], ref: list[float]) -> None:
    """A run of base_yaml's 6 steps with `liger_fsdp: true` against the same run without it: every step's loss,
    rel <= 1e-4 (fp32; summation order differs)."""
    assert len(losses) == len(ref) == 6, (losses, ref)
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, ref)


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


def peft_logits(assets, adapter_dir, ids):
    """Logits of the base model + the adapter in ``adapter_dir``, loaded with plain PEFT (no plugin)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(assets / "model"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def export_logits(assets, out, tmp_path, ids):
    """`llamafactory-cli export` (merge) of the adapter in ``out``; logits of the merged model."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    export_dir = tmp_path / "merged"
    cfg = dict(
        model_name_or_path=str(assets / "model"), adapter_name_or_path=str(out), template="llama3",
        finetuning_type="lora", export_dir=str(export_dir), export_device="cpu", export_size=1,
    )
    path = tmp_path / "export.yaml"
    path.write_text(yaml.safe_dump(cfg))
    bindir = Path(sys.executable).parent
    proc = subprocess.run(
        [str(bindir / "llamafactory-cli"), "export", str(path)], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    merged = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        return merged(input_ids=ids).logits.float()
