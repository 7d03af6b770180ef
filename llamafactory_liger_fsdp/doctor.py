"""``python -m llamafactory_liger_fsdp doctor [sft.yaml [key=value ...]]``: versions, whether the import hook
is active, and for a yaml what the plugin will decide, with the same code as training (a v1 yaml: :mod:`.doctor_v1`).

Works on a machine without a GPU (a login node): when LLaMA-Factory rejects the yaml only because of this
machine (``bf16`` without a GPU, a ``deepspeed:`` yaml outside a torchrun rank, a Triton backend without
CUDA) that is reported on its own line and the plugin's decision is evaluated as on the machine the yaml
is for. A hub model id that cannot be read offline still gets the head kind the yaml trains. Exit status:
0 whenever the yaml would train there (engaged, or off, or not needed), 1 when training would stop (a
refusal, a rejected yaml, an inactive hook with the flag on).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from . import refusals
from . import versions as policy

PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "deepspeed", "llamafactory", "liger-kernel",
            "llamafactory-liger-fsdp")
INACTIVE_FIX = ("run `python -m llamafactory_liger_fsdp train <yaml>` instead of `llamafactory-cli train <yaml>` "
                "(it activates the plugin in the launcher and every worker), or install with `pip install .` into this "
                "environment's site-packages")


def versions() -> dict[str, str | None]:
    return {name: policy.installed(name) for name in PACKAGES}


HOOK_CHECK = ("import sys; b = sys.modules.get('llamafactory_liger_fsdp._bootstrap'); "
              "print(int(bool(b is not None and b.ACTIVE and 'torch' not in sys.modules)))")


def hook_status(python: list[str] | None = None, env: dict | None = None) -> tuple[bool, str]:
    """Whether a fresh interpreter of this environment got the import hook *at start* (the ``.pth`` ran, or
    ``python -m llamafactory_liger_fsdp train``'s activation): nothing is imported to find out, since importing
    ``_bootstrap`` would install the hook and prove nothing."""
    import subprocess

    proc = subprocess.run([*(python or [sys.executable]), "-c", HOOK_CHECK], capture_output=True, text=True,
                          env=env if env is not None else dict(os.environ))
    if proc.stdout.strip() == "1":
        return True, "active (the .pth file registers it in every Python process of this environment)"
    return False, f"NOT active in this environment. Fix: {INACTIVE_FIX}"


def _parse(path: str, overrides: list[str], machine_overrides: dict | None = None):
    from llamafactory.hparams import get_train_args
    from llamafactory.hparams.parser import read_args

    saved = sys.argv
    sys.argv = ["llamafactory-cli", path, *overrides]
    try:
        raw = read_args()
    finally:
        sys.argv = saved
    args = {k: v for k, v in dict(raw, **(machine_overrides or {})).items() if v is not None}
    with refusals.for_another_machine():  # what this machine cannot run is reported apart
        return raw, get_train_args(args)


#: Parsed "as on the GPU machine the yaml is for": no bf16/GPU check, and no `deepspeed:` key (LLaMA-Factory parses it
#: inside a torchrun rank only); the sharding is then decided from the yaml's DeepSpeed json.
FOR_THE_GPU_MACHINE = {"use_cpu": True, "deepspeed": None}


def check_yaml(path: str, overrides: list[str] | None = None, accelerate: dict | None = None) -> tuple[bool, list[str]]:
    """(would train, report lines); ``accelerate``: the config of an ``accelerate launch`` (its yaml as a dict). The
    plugin's own log lines are quiet meanwhile (a clean report)."""
    from ._log import logger

    level = logger.level
    logger.setLevel("WARNING")
    try:
        return _check_yaml(path, overrides, accelerate)
    finally:
        logger.setLevel(level)


def _check_yaml(path: str, overrides: list[str] | None, accelerate: dict | None) -> tuple[bool, list[str]]:
    """(would train, report lines)."""
    from types import SimpleNamespace

    from . import config, predict, sharding
    from .config import LigerFsdpConfigError

    lines: list[str] = []
    overrides = list(overrides or [])
    try:
        try:
            raw, parsed = _parse(path, overrides)
        except LigerFsdpConfigError:
            raise
        except (ValueError, ImportError) as exc:
            try:  # rejected because of this machine only? evaluate as on the GPU machine
                raw, parsed = _parse(path, overrides, FOR_THE_GPU_MACHINE)
            except LigerFsdpConfigError:
                raise
            except Exception:
                return False, [f"LLaMA-Factory rejects this yaml: {exc}"]
            lines.append(f"this machine: LLaMA-Factory would reject the yaml here ({exc}); what follows is evaluated as on "
                         "the GPU machine it is for" + (" (launched with FORCE_TORCHRUN=1, as DeepSpeed needs)"
                                                         if raw.get("deepspeed") else "") + ".")
            finetuning = parsed[3]
            cfg = config.get_config(finetuning)
            if cfg.enabled and raw.get("deepspeed"):  # decided from the yaml's json, as every rank will
                decided = sharding.decide(SimpleNamespace(deepspeed=raw["deepspeed"]))
                setattr(finetuning, config.ATTR, dataclasses.replace(cfg, sharding=decided))
                refusals.check_raw(raw, decided, cfg, machine=False)
    except LigerFsdpConfigError as exc:
        return False, lines + [f"error: {exc}"]
    model_args, _, training_args, finetuning_args, _ = parsed
    cfg = config.get_config(finetuning_args)
    if cfg.enabled and accelerate is not None:  # the sharding the processes of `accelerate launch` decide
        decided = sharding.decide(training_args, {**os.environ, **sharding.accelerate_env(accelerate)})
        cfg = dataclasses.replace(cfg, sharding=decided)
        try:
            refusals.check_parsed(dict(training=training_args, finetuning=finetuning_args, model=model_args), decided,
                                  cfg, machine=False)
        except LigerFsdpConfigError as exc:
            return False, lines + [f"error: {exc}"]
        setattr(finetuning_args, config.ATTR, cfg)
    if not cfg.enabled:
        why = f"disabled by {config.DISABLE_ENV}" if config.disabled_by_env() else "`liger_fsdp` is not true in this yaml"
        return True, lines + [f"plugin off ({why}): the run trains without it."]
    problem = refusals.machine_problem(cfg)
    if problem:
        lines.append(f"this machine: {problem}")
    lines.append(f"liger_fsdp: on (backend {cfg.backend}); stage {finetuning_args.stage}; first-step exactness guard "
                 f"{'on' if cfg.guard else 'off (`liger_fsdp_guard: false`)'}.")
    if cfg.sharding.kind == sharding.NONE:
        lines.append("sharding: none as one process; under `accelerate launch` it is what the accelerate config says "
                     "(FSDP, DeepSpeed or DDP: give it as `--accelerate-config <file>`), under torchrun "
                     "(FORCE_TORCHRUN=1) DDP unless the yaml sets `fsdp` or `deepspeed`.")
    else:
        lines.append(f"sharding: {cfg.sharding.label} (from {cfg.sharding.source}).")
    if cfg.sharding.kind == sharding.DEEPSPEED and cfg.sharding.zero_stage == 3 and (raw.get("bf16") or raw.get("fp16")):
        lines.append("dtypes: DeepSpeed ZeRO-3 in 16 bits: trainable parameters of mixed dtypes are cast to the compute "
                     "dtype after loading, as DeepSpeed does itself under ZeRO-0/1/2 (fp32 masters in its optimizer).")
    decision = predict.decide(model_args, finetuning_args)
    if decision.family:
        quirks = f" (quirks: {', '.join(decision.quirks)})" if decision.quirks else ""
        lines.append(f"model type {decision.family}{quirks}.")
        if decision.model_class:
            lines.append(f"model class {decision.model_class} (the class LLaMA-Factory builds for it).")
    if decision.error:
        return False, lines + [f"error: {decision.error}"]
    if decision.note:
        lines.append(decision.note + ".")
    if decision.not_engaged:
        return True, lines + [f"not engaged: {decision.not_engaged}; the plain loss has nothing to fix (the run trains)."]
    if getattr(training_args, "label_smoothing_factor", 0):
        lines.append(f"label_smoothing_factor {training_args.label_smoothing_factor}: the fused kernel computes the "
                     "smoothed loss for causal-LM classes; for image-text classes the Trainer smooths the full logits "
                     "itself and the fused path is bypassed (the run trains correctly, without the memory saving).")
    if decision.head:
        where = "on the meta-device model LLaMA-Factory would build" if decision.family else "from the yaml alone"
        lines.append(f"will engage: {decision.head} (decided {where}).")
    if cfg.sharding.fsdp_version:
        sd = os.environ.get("FSDP_STATE_DICT_TYPE") or (
            "FULL_STATE_DICT (set at load time for an FSDP2 adapter run)" if cfg.sharding.fsdp_version == 2 and
            finetuning_args.finetuning_type in ("lora", "oft") else "accelerate's default")
        lines.append(f"checkpoints: state dict {sd}.")
    return True, lines


def _raw(argv: list[str]) -> dict | None:
    """The yaml as a dict (for telling a v1 yaml apart), None where it cannot be read."""
    from . import v1_args

    try:
        return v1_args.read_raw(argv)
    except Exception:
        return None


USAGE = """usage: python -m llamafactory_liger_fsdp doctor [<yaml|json> [key=value ...]] [--accelerate-config <file>]

Prints the installed versions and whether the import hook is active; with a yaml (or json), what the plugin decides
for it, evaluated with the same code as training (a v1 yaml, `model:`, with the v1 engine's rules). key=value
overrides are read as `llamafactory-cli train` reads them. --accelerate-config: the config of an `accelerate launch`
of the yaml, read for the sharding. Exit status 1 when training would stop (a refusal, a rejected yaml)."""


def _accelerate_config(argv: list[str]) -> tuple[list[str], dict | None]:
    """``argv`` without ``--accelerate-config <file>`` (or ``=<file>``), and that accelerate config (a dict)."""
    rest, path = [], None
    items = iter(argv)
    for item in items:
        if item == "--accelerate-config":
            path = next(items, None)
        elif item.startswith("--accelerate-config="):
            path = item.split("=", 1)[1]
        else:
            rest.append(item)
    if path is None:
        return rest, None
    import yaml

    with open(path, encoding="utf-8") as f:
        return rest, yaml.safe_load(f) or {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doctor":
        argv = argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    argv, accelerate = _accelerate_config(argv)
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    print("llamafactory-liger-fsdp doctor")
    for name, version in versions().items():
        print(f"  {name:24s} {version or 'not installed'}")
    old, newer = policy.too_old(), policy.untested()
    if old:
        print(f"  too old for the plugin (refused with liger_fsdp: true): {', '.join(old)}")
    if newer:
        print(f"  newer than tested (trains; the first-step guard checks the loss): {', '.join(newer)}")
    active, why = hook_status()
    print(f"  import hook: {why}")
    if not argv:
        return 0
    from . import _bootstrap

    _bootstrap.install()  # evaluate the yaml as the hook would, even where it is not active
    from . import doctor_v1

    if doctor_v1.is_v1(_raw(argv)):
        ok, lines = doctor_v1.check_yaml(argv[0], argv[1:])
    else:
        ok, lines = check_yaml(argv[0], argv[1:], accelerate)
    print(f"\n{argv[0]}:")
    for line in lines:
        print(f"  {line}")
    flag_on = any(line.startswith("liger_fsdp: on") for line in lines)
    if flag_on and not active:
        print(f"  the import hook is not active here, so `llamafactory-cli train` would reject `liger_fsdp`. Fix: {INACTIVE_FIX}.")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
