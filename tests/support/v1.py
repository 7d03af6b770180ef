"""``USE_V1=1 llamafactory-cli sft`` on the tiny assets: the yaml, the run (2 gloo ranks), its losses and weights."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .cli import ROOT

SHIM = ROOT / "llamafactory_liger_fsdp" / "testing" / "cpu_v1_shim"


def v1_yaml(assets: Path, out: Path, head: str = "mts", plugin: bool = True, **overrides) -> dict:
    """A v1 SFT yaml (3 steps, fp32, normal batching). ``head``: mts (LoRA + ``modules_to_save: [lm_head]``), lora
    (LoRA on the head too), full (no peft_config). An override of None removes the key."""
    data = out.parent / (out.name + "_data.yaml")
    data.write_text(json.dumps({"tiny": {"path": str(assets / "data" / "tiny_alpaca.json"), "source": "local",
                                         "converter": "alpaca"}}))
    cfg = dict(model=str(assets / "model"), train_dataset=str(data), output_dir=str(out), micro_batch_size=2,
               cutoff_len=64, max_steps=3, bf16=False, batching_workers=0, enable_activation_checkpointing=False,
               logging_steps=1, learning_rate=1.0e-3, dist_config={"name": "fsdp2"})
    lora = {"name": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all"}
    if head == "mts":
        cfg["peft_config"] = dict(lora, modules_to_save=["lm_head"])
    elif head == "lora":
        cfg["peft_config"] = dict(lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj", "lm_head"])
    if plugin:
        cfg["kernel_config"] = {"name": "liger_fsdp"}
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}


def v1_pairs(assets: Path, out: Path) -> Path:
    """The tiny pairwise rows as v1's ``pair`` converter reads them (chosen/rejected message lists)."""
    rows = json.loads((assets / "data" / "tiny_pairs.json").read_text())
    pairs = [{side: [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r[side]}]
              for side in ("chosen", "rejected")} for r in rows]
    path = out.parent / (out.name + "_pairs.json")
    path.write_text(json.dumps(pairs))
    data = out.parent / (out.name + "_pairs.yaml")
    data.write_text(json.dumps({"pairs": {"path": str(path), "source": "local", "converter": "pair"}}))
    return data


def run_v1(cfg: dict, nproc: int = 2, command: str = "sft", timeout: int = 600, shims: tuple = ()) -> tuple[int, str]:
    """(returncode, log) of ``USE_V1=1 llamafactory-cli <command> cfg.yaml`` on ``nproc`` CPU ranks; ``shims``:
    directories put before the v1 shim on PYTHONPATH (each one's sitecustomize hands on to the next)."""
    import yaml

    out = Path(cfg["output_dir"])
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / (out.name + ".yaml")
    path.write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, USE_V1="1", FORCE_TORCHRUN="1", NPROC_PER_NODE=str(nproc), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([*map(str, shims), str(SHIM), os.environ.get("PYTHONPATH", "")]))
    for key in ("LLAMAFACTORY_LIGER_FSDP_SAID_DISABLED", "LLAMAFACTORY_LIGER_FSDP_SAID_VERSIONS"):
        env.pop(key, None)
    for _ in range(2):  # a gloo rank of v1 (with or without the plugin) aborts now and then (SIGABRT): run it again once
        shutil.rmtree(out, ignore_errors=True)  # from scratch: v1 appends to a trainer_log.jsonl it finds
        out.mkdir(parents=True)
        proc = subprocess.run([os.path.join(bindir, "llamafactory-cli"), command, str(path)], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=str(out.parent))
        log = proc.stdout + proc.stderr
        if proc.returncode == 0 or "exitcode  : -6" not in log:
            break
    return proc.returncode, log


def losses(out: Path) -> list[float]:
    """Per-step losses from v1's trainer_log.jsonl."""
    rows = [json.loads(line) for line in (Path(out) / "trainer_log.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"]) if "loss" in r]


def weights(out: Path) -> dict:
    """The saved adapter or model tensors."""
    from safetensors.torch import load_file

    files = sorted(Path(out).glob("adapter_model*.safetensors")) or sorted(Path(out).glob("model*.safetensors"))
    assert files, f"nothing saved in {out}"
    found = {}
    for f in files:
        found.update(load_file(str(f)))
    return found
