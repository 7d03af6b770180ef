"""The versions the plugin was tested with, and which installed ones fall outside them.

``TESTED`` holds the same ranges as ``pyproject.toml``: LLaMA-Factory 0.9.5's own stack (transformers 5.6, peft 0.18,
accelerate 1.11) with torch 2.11 and triton 3.6 (the README's CPU stack, ``scripts/test.sh``), what a plain
``pip install llamafactory==0.9.5`` brings today (torch 2.14, triton 3.8: ``scripts/test_latest.sh``), and the GPU
image's newer HF stack (transformers 5.17, peft 0.21, accelerate 1.15, where the kernel and parity tests ran).
Outside them the family quirks (read off transformers 5.6) and the patch points may differ: the plugin stops once,
before any rank starts, with the list, unless ``liger_fsdp_allow_untested_versions: true``. Imports no torch.
"""

from __future__ import annotations

import re
from importlib import metadata

#: distribution -> (lowest, highest) tested release, compared on the leading (major, minor[, patch]) numbers.
TESTED = {
    "torch": ("2.11", "2.14"),
    "triton": ("3.6", "3.8"),
    "transformers": ("5.6", "5.17"),
    "peft": ("0.18", "0.21"),
    "accelerate": ("1.11", "1.15"),
    "llamafactory": ("0.9.5", "0.9.5"),
}


def _key(version: str, parts: int) -> tuple[int, ...]:
    numbers = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:parts]]
    return tuple(numbers + [0] * (parts - len(numbers)))


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def untested(found: dict[str, str | None] | None = None) -> list[str]:
    """``"name X (tested: lo-hi)"`` for every installed distribution outside its tested range."""
    out = []
    for name, (lo, hi) in TESTED.items():
        version = (found or {}).get(name) if found is not None else installed(name)
        if version is None:
            continue
        parts = max(len(lo.split(".")), len(hi.split(".")))
        if not _key(lo, parts) <= _key(version, parts) <= _key(hi, parts):
            out.append(f"{name} {version} (tested: {lo}" + (f" to {hi})" if hi != lo else ")"))
    return out
