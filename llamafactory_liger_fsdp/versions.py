"""The version policy: which installed versions the plugin refuses, which it trains on, which it names as untested.

Three answers for each distribution the plugin patches or whose code it reproduces (compared with
``packaging.version``, the one place versions are compared):

* older than :data:`MINIMUM` -- refused before any rank starts, naming the version and the upgrade (the patch points,
  the loss function and the FSDP2/PEFT types the plugin recognises are those of these releases on);
* a combination in :data:`BROKEN` -- refused with the reason;
* newer than :data:`TESTED` -- trains; one line (rank 0) names what is untested, and the first-step guard, which
  compares the fused loss with the model's own forward, stops the run with its message if a newer library changed
  what the loss sees (the family quirks were read off transformers 5.6).

A version string does not say which code is installed (every commit of LLaMA-Factory's git main reports
``0.9.6.dev0``): an upstream function the run uses whose code CI never saw is untested too (:mod:`.fingerprints`).

``pyproject.toml`` states no ranges for these: installing the plugin never changes a user's stack (an old version is
refused at run time with the fix instead of being replaced by pip). docs/design.md, "Versions". Imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .pieces import installed  # noqa: F401  (versions.installed: what the checks below and their callers read)

#: distribution -> the oldest release the plugin works with (refused below).
MINIMUM = {
    "torch": "2.11",
    "triton": "3.6",
    "transformers": "5.6",
    "peft": "0.18",
    "accelerate": "1.11",
    "llamafactory": "0.9.5",
}

#: distribution -> the newest release tested in CI (a plain ``X.Y`` covers every ``X.Y.z``; a dev release covers
#: itself only): the largest of the three stacks ``scripts/test.sh`` and ``scripts/test_stacks.sh`` run -- the pinned
#: ``requirements-cpu.txt`` (torch 2.11, triton 3.6, transformers 5.6, peft 0.18.1, accelerate 1.11, LLaMA-Factory
#: 0.9.5), ``pip install llamafactory==0.9.5`` as PyPI resolved it (torch 2.15, triton 3.9; the rest as pinned) and
#: LLaMA-Factory git main from the snapshot (0.9.6.dev0 with transformers 5.8). Not the GPU image's: no test runs there.
TESTED = {
    "torch": "2.15",
    "triton": "3.9",
    "transformers": "5.8",
    "peft": "0.18",
    "accelerate": "1.11",
    "llamafactory": "0.9.6.dev0",
}


@dataclass(frozen=True)
class Broken:
    """A combination of installed versions known to break (each ``(name, specifier)`` must match)."""

    match: tuple[tuple[str, str], ...]
    reason: str
    fix: str
    applies: Callable[[str], bool] = lambda backend: True  # given the run's `liger_fsdp_backend`


def _interpreted(backend: str) -> bool:
    return backend in ("triton", "triton_fast") and os.environ.get("TRITON_INTERPRET", "") == "1"


#: Known breakages, refused with their reason.
BROKEN = (
    Broken((("triton", "<3.7"), ("numpy", ">=2.4")),
           "triton < 3.7's interpreter (TRITON_INTERPRET=1, how the Triton kernels run on a CPU) fails on numpy >= 2.4 "
           "('only 0-dimensional arrays can be converted to Python scalars') at the first kernel launch",
           "pip install 'numpy<2.4' (or triton >= 3.7), or unset TRITON_INTERPRET", _interpreted),
)


def _parse(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def at_least(version: str, release: str) -> bool:
    """``version >= release`` (PEP 440; ``1.15.0.dev0`` is before ``1.15.0``)."""
    return Version(version) >= Version(release)


def _newer(version: Version, newest: str) -> bool:
    """Past the tested release: any later release for ``X.Y``; for a dev or pre-release top, anything after it (a
    later dev release of the same version included; a local ``+build`` label is ignored)."""
    top = Version(newest)
    if top.is_prerelease or top.is_devrelease:
        return Version(version.public) > top
    return version.release[:len(top.release)] > top.release


def _found(found: dict[str, str | None] | None, name: str) -> str | None:
    return found.get(name) if found is not None else installed(name)


def _older(found: dict[str, str | None] | None) -> list[tuple[str, str, str]]:
    """(name, installed, minimum) of every installed distribution older than :data:`MINIMUM`."""
    out = []
    for name, low in MINIMUM.items():
        version = _found(found, name)
        parsed = _parse(version) if version else None
        if parsed is not None and parsed.release[:len(Version(low).release)] < Version(low).release:
            out.append((name, version, low))
    return out


def too_old(found: dict[str, str | None] | None = None) -> list[str]:
    """``"torch 2.9.1 (needs >= 2.11)"`` for every installed distribution older than :data:`MINIMUM`."""
    return [f"{name} {version} (needs >= {low})" for name, version, low in _older(found)]


def upgrade_command(found: dict[str, str | None] | None = None) -> str | None:
    """``pip install 'torch>=2.11' ...`` for what :func:`too_old` names (None when nothing is too old)."""
    old = _older(found)
    return "pip install " + " ".join(f"'{name}>={low}'" for name, _, low in old) if old else None


def broken(backend: str = "auto", found: dict[str, str | None] | None = None) -> list[Broken]:
    """The entries of :data:`BROKEN` that match the installed versions (and apply to ``backend`` on this machine)."""
    hits = []
    for entry in BROKEN:
        versions = [_found(found, name) for name, _ in entry.match]
        if all(v is not None and _parse(v) is not None and SpecifierSet(spec).contains(_parse(v), prereleases=True)
               for v, (_, spec) in zip(versions, entry.match)) and entry.applies(backend):
            hits.append(entry)
    return hits


def untested(found: dict[str, str | None] | None = None) -> list[str]:
    """``"torch 2.16.0 (tested up to 2.15)"`` for every installed distribution newer than :data:`TESTED`; for the
    installed ones (``found`` None) also every upstream function this run uses whose code CI never saw, whatever its
    version string (:func:`.fingerprints.unseen`)."""
    out = []
    for name, newest in TESTED.items():
        version = _found(found, name)
        parsed = _parse(version) if version else None
        if parsed is not None and _newer(parsed, newest):
            out.append(f"{name} {version} (tested up to {newest})")
    if found is None:
        from . import fingerprints

        out += fingerprints.unseen()
    return out


def note(guard: bool, found: dict[str, str | None] | None = None) -> str | None:
    """The one line a run on untested versions logs (rank 0), or None."""
    newer = untested(found)
    if not newer:
        return None
    check = ("the first-step guard compares the fused loss with the model's own forward and stops the run if they "
             "differ" if guard else "`liger_fsdp_guard: false`: nothing checks the fused loss against the model's own "
             "on these versions (remove that key to check step 1)")
    return f"[liger_fsdp] untested versions: {', '.join(newer)}; training as usual, {check}."


def refuse_too_old(setting: str, remove: str) -> None:
    """Raise the one refusal of releases older than :data:`MINIMUM` (both engines): ``setting`` names what the user
    wrote (e.g. ```liger_fsdp: true```), ``remove`` how to train without the plugin."""
    old = too_old()
    if old:
        from .config import LigerFsdpConfigError

        raise LigerFsdpConfigError(
            f"{setting} needs newer releases than installed: {', '.join(old)}; the patch points, the loss function and "
            f"the sharding types it works with are those of these releases on. Fix: {upgrade_command()}, {remove}."
        )
