"""``python -m llamafactory_liger_fsdp doctor [sft.yaml]``: what is installed, whether the import
hook is active, and -- for a yaml -- whether the plugin will engage, and if not, why.

The yaml check runs LLaMA-Factory's own argument parser (so every error is the one training
would raise), reads the model's config (no weights), and predicts the head kind from the yaml:
``additional_target``/``lora_target`` naming ``lm_head``, or full fine-tuning.
"""

from __future__ import annotations

import sys
from importlib import metadata

PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "llamafactory", "liger-kernel", "llamafactory-liger-fsdp")


def versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hook_status() -> tuple[bool, str]:
    """Whether a fresh interpreter of this environment has the import hook (the .pth file)."""
    import subprocess

    code = "import sys; import llamafactory_liger_fsdp._bootstrap as b; print(int(b.ACTIVE and 'torch' not in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    active = proc.stdout.strip() == "1"
    if active:
        return True, "active (the .pth file registers it in every Python process of this environment)"
    from . import _bootstrap

    if _bootstrap._disabled():
        return False, f"disabled by {_bootstrap.DISABLE_ENV}"
    return False, "NOT active: reinstall with `pip install .` (or `pip install -e .`) in this environment"


def _head_from_args(model_args, finetuning_args) -> str | None:
    """The head kind the yaml asks for, or None when the head stays frozen."""
    ft = finetuning_args.finetuning_type
    if ft == "full":
        return "full"
    if ft == "lora":
        extra = finetuning_args.additional_target or []
        if any(t.split(".")[-1] == "lm_head" for t in extra):
            return "modules_to_save"
        targets = finetuning_args.lora_target or []
        if any(t.split(".")[-1] == "lm_head" for t in targets):
            return "lora"
        return None
    if ft == "freeze":
        extra = getattr(finetuning_args, "freeze_extra_modules", None) or []
        return "full" if any("lm_head" in t for t in extra) else None
    return None


def check_yaml(path: str) -> tuple[bool, list[str]]:
    """Return (will_engage, lines of explanation)."""
    from . import config, families

    import os

    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    lines: list[str] = []
    try:
        from llamafactory.hparams import get_train_args

        saved = sys.argv
        sys.argv = ["llamafactory-cli", path]
        try:
            model_args, _, training_args, finetuning_args, _ = get_train_args()
        finally:
            sys.argv = saved
    except config.LigerFsdpConfigError as exc:
        return False, [f"error: {exc}"]
    except (ValueError, ImportError) as exc:
        return False, [f"LLaMA-Factory rejects this yaml: {exc}"]
    cfg = config.get_config(finetuning_args)
    if not cfg.enabled:
        return False, ["`liger_fsdp` is not set to true in this yaml: the plugin stays off."]
    lines.append(f"liger_fsdp: on (backend {cfg.backend}); stage {finetuning_args.stage}.")
    try:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
        family = families.family_of(getattr(model_config, "model_type", None))
        lines.append(f"model type {family.model_type}: supported"
                     + (f" (final-logit softcap {families.softcap(family, model_config)})" if family.softcap_attr else "")
                     + (" (MoE aux loss kept)" if family.moe else "") + ".")
        tied = bool(getattr(model_config, "tie_word_embeddings", False))
    except config.LigerFsdpConfigError as exc:
        return False, lines + [f"error: {exc}"]
    except Exception as exc:  # config not readable offline, etc.
        lines.append(f"could not read the model config ({exc!r}); the family is checked again at load time.")
        tied = False
    kind = _head_from_args(model_args, finetuning_args)
    if kind is None:
        return False, lines + ["not engaged: lm_head stays frozen with these settings (not in `additional_target` or "
                               "`lora_target`, no full fine-tuning), so the plain loss has nothing to fix."]
    fsdp = "none"
    if training_args.fsdp:
        fsdp = f"FSDP{int((training_args.fsdp_config or {}).get('version', 1))}"
    lines.append(f"will engage: head={kind}{' (tied embeddings)' if tied else ''}, fsdp={fsdp} (from the yaml; "
                 "accelerate configs are read at launch).")
    if fsdp != "none":
        sd = os.environ.get("FSDP_STATE_DICT_TYPE") or ("FULL_STATE_DICT" if fsdp == "FSDP1" else "SHARDED_STATE_DICT")
        lines.append(f"checkpoints: state dict {sd}" + (
            "; adapter checkpoints hold full tensors and resume on every rank." if sd == "FULL_STATE_DICT" else "."))
    return True, lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doctor":
        argv = argv[1:]
    print("llamafactory-liger-fsdp doctor")
    for name, version in versions().items():
        print(f"  {name:24s} {version or 'not installed'}")
    active, why = hook_status()
    print(f"  import hook: {why}")
    if not argv:
        return 0 if active else 1
    ok, lines = check_yaml(argv[0])
    print(f"\n{argv[0]}:")
    for line in lines:
        print(f"  {line}")
    return 0 if (active and ok) else 1


if __name__ == "__main__":
    sys.exit(main())
