"""``python -m llamafactory_liger_fsdp env``: one paste for a bug report.

Prints the plugin's version, every library the version policy (:mod:`.versions`) checks with its minimum, the newest
tested release and what the policy makes of the installed one, the other libraries a run may use, the LLaMA-Factory
functions the plugin depends on whose code CI never saw (:mod:`.fingerprints`), the device and the kernel backend
``liger_fsdp_backend: auto`` would pick there, whether the ``.pth`` import hook is active, and the environment
variables that change what the plugin or LLaMA-Factory do. Runs without a GPU and without LLaMA-Factory.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from importlib.util import find_spec

from . import __version__
from . import versions as policy
from .args import ENV_TRUE

#: Libraries a run may use beyond the ones :data:`versions.MINIMUM` checks (reported, not judged).
OTHERS = ("numpy", "deepspeed", "liger-kernel", "bitsandbytes", "trl", "datasets")

#: Environment variables that change what the plugin or LLaMA-Factory do.
SWITCHES = ("LLAMAFACTORY_LIGER_FSDP_DISABLE", "LLAMAFACTORY_LIGER_FSDP_PTH", "DISABLE_VERSION_CHECK", "USE_V1",
            "FORCE_TORCHRUN", "NPROC_PER_NODE", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "FSDP_STATE_DICT_TYPE")


def verdict(name: str, version: str | None) -> str:
    """What the version policy makes of ``name`` at ``version``."""
    if version is None:
        return "not installed"
    found = {name: version}
    if policy.too_old(found):
        return f"too old: refused with liger_fsdp: true (needs >= {policy.MINIMUM[name]})"
    if policy.untested(found):
        return "newer than tested: trains, the first-step guard checks the loss"
    return "tested"


def library_lines() -> list[str]:
    lines = [f"  {'library':14s} {'installed':22s} {'minimum':9s} {'tested up to':13s} verdict"]
    for name in policy.MINIMUM:
        version = policy.installed(name)
        lines.append(f"  {name:14s} {version or '-':22s} {policy.MINIMUM[name]:9s} {policy.TESTED[name]:13s} "
                     f"{verdict(name, version)}")
    for name in OTHERS:
        lines.append(f"  {name:14s} {policy.installed(name) or 'not installed'}")
    for entry in policy.broken("triton"):
        lines.append(f"  known to break here: {entry.reason}. Fix: {entry.fix}")
    return lines


def llamafactory_check() -> list[str]:
    """What LLaMA-Factory's own start-up check (``extras/misc.py``'s ``check_dependencies``, read as text) makes of
    the installed libraries: a release outside its ranges stops ``llamafactory-cli`` unless DISABLE_VERSION_CHECK=1."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    spec = find_spec("llamafactory")
    path = os.path.join(spec.submodule_search_locations[0], "extras", "misc.py") if spec and \
        spec.submodule_search_locations else None
    if path is None or not os.path.exists(path):
        return []
    body = open(path, encoding="utf-8").read().partition("def check_dependencies")[2].partition("\ndef ")[0]
    outside = []
    for requirement in re.findall(r'check_version\("([A-Za-z0-9_.-]+)([^"]*)"\)', body):
        name, ranges = requirement
        version = policy.installed(name)
        try:
            if version is not None and not SpecifierSet(ranges).contains(version, prereleases=True):
                outside.append(f"{name} {version} (LLaMA-Factory requires {name}{ranges})")
        except InvalidSpecifier:
            continue
    if not outside:
        return ["  LLaMA-Factory's own version check: every library within its ranges"]
    skipped = os.environ.get("DISABLE_VERSION_CHECK", "").lower() in ENV_TRUE  # LLaMA-Factory's is_env_enabled
    then = ("skipped here (DISABLE_VERSION_CHECK is set)" if skipped else
            "llamafactory-cli stops at start; DISABLE_VERSION_CHECK=1 skips that check")
    return [f"  LLaMA-Factory's own version check: {', '.join(outside)}: {then}"]


def code_lines() -> list[str]:
    """LLaMA-Factory's functions the plugin depends on whose code CI never saw (its version string may be one CI
    tested: every git main reports 0.9.6.dev0); transformers' are left to its version (a release bumps it)."""
    if find_spec("llamafactory") is None:
        return []
    from . import fingerprints

    try:
        gone = fingerprints.missing("llamafactory")
    except Exception as err:  # a broken install: say so, the rest of the report still prints
        return [f"  LLaMA-Factory code: not checked ({type(err).__name__}: {err})"]
    if not gone:
        return [f"  LLaMA-Factory code: every function the plugin depends on is code CI ran "
                f"({len(fingerprints.this_stack('llamafactory'))} checked)"]
    return [f"  LLaMA-Factory code CI never saw (untested whatever the version; the guard stops where it cannot "
            f"compare): {', '.join(gone)}"]


def device_lines() -> list[str]:
    """The device training would use and the backend ``auto`` picks there (imports torch)."""
    try:
        import torch
    except ImportError as err:
        return [f"  device: unknown (torch does not import: {err})"]
    from .ops import default_backend

    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        where = f"cuda ({torch.cuda.device_count()} x {name}, {props.total_memory / 2**30:.1f} GiB each)"
    else:
        device = torch.device("cpu")
        where = f"cpu ({os.cpu_count()} cores; torch built for CUDA {torch.version.cuda or 'none'})"
    backend = default_backend(device, fast=True)
    return [f"  device: {where}", f"  liger_fsdp_backend auto -> {backend}"]


def hook_line() -> str:
    from .doctor import hook_status

    _, why = hook_status()
    return f"  import hook: {why}"


def lines() -> list[str]:
    out = [f"llamafactory-liger-fsdp {__version__}",
           f"  python {platform.python_version()} ({sys.executable}) on {platform.platform()}"]
    out += library_lines()
    out += llamafactory_check()
    out += code_lines()
    out += device_lines()
    out.append(hook_line())
    out += [f"  {key}={os.environ[key]}" for key in SWITCHES if key in os.environ]
    return out


def main(argv: list[str] | None = None) -> int:
    print("\n".join(lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
