"""``python -m llamafactory_liger_fsdp doctor [sft.yaml [key=value ...]]``: versions, whether the import hook
is active, and for a yaml what the plugin will decide, with the same code as training (a v1 yaml: :mod:`.integration.v1.doctor`).

Works on a machine without a GPU (a login node): when LLaMA-Factory rejects the yaml only because of this
machine (``bf16`` without a GPU, a ``deepspeed:`` yaml outside a torchrun rank, a Triton backend without
CUDA) that is reported on its own line and the plugin's decision is evaluated as on the machine the yaml
is for. A hub model id that cannot be read offline still gets the head kind the yaml trains. Exit status:
0 whenever the yaml would train there (engaged, or off, or not needed), 1 when training would stop (a
refusal, a rejected yaml, an inactive hook with the flag on).
"""

from __future__ import annotations

import os
import sys

from . import versions as policy
from .doctor_yaml import check_yaml

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


def _raw(argv: list[str]) -> dict | None:
    """The yaml as a dict (for telling a v1 yaml apart), None where it cannot be read."""
    from .integration.v1 import args as v1_args

    try:
        return v1_args.read_raw(argv)
    except Exception:
        return None


USAGE = """usage: python -m llamafactory_liger_fsdp doctor [sft|dpo|rm] [<yaml|json> [key=value ...]]
                                          [--accelerate-config <file>]

Prints the installed versions and whether the import hook is active; with a yaml (or json), what the plugin decides
for it, evaluated with the same code as training (a v1 yaml, `model:`, with the v1 engine's rules; the v1 command
before it, as `llamafactory-cli <command> <yaml>` takes it, checks that command: `dpo` where v1 has no DPO). key=value
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
    from .integration.v1 import doctor as doctor_v1

    command = argv.pop(0) if len(argv) > 1 and argv[0] in doctor_v1.COMMANDS else None  # v1: `doctor dpo <yaml>`
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
    if doctor_v1.is_v1(_raw(argv)):  # the command only matters to v1 (a default-engine yaml names its stage)
        ok, lines = doctor_v1.check_yaml(argv[0], argv[1:], command)
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
