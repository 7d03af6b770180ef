"""The one reader of a v1 yaml's sequence-parallel settings (``cp_size``, ``cp_mode``, ``dist_config``), and what the
plugin takes of them, decided from the yaml alone: the launching process, every rank (through :func:`.v1_args.check`)
and ``doctor`` read them here. Imports no torch at module level.

Each LLaMA-Factory reads the settings in one place: git main at the top level (``cp_size``, ``cp_mode``), 0.9.5 only
inside ``dist_config`` (:func:`spelling`, from the installed ``TrainingArguments``). :func:`read` answers what the
installed one will run; the other spelling is refused (0.9.5 stops every rank on an unknown key; git main ignores
``dist_config.cp_size`` and would train without sequence parallelism). This is the yaml's ``cp_size``;
:func:`.ulysses.cp_size` is the runtime CP group's size (v1's ``DistributedInterface``), read once a run started.

Exact and tested (:mod:`.cp`, :mod:`.cp_rm`, :mod:`.cp_dpo`): SFT, RM and DPO, Ulysses, under v1's FSDP2, with
``flash_attn: flash_attention_2``. Everything else under CP is refused here (:data:`RULES`), once, before the ranks
start, as one message naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import sys
from collections.abc import Mapping
from typing import Any, Callable

from ... import versions
from ...config import LigerFsdpConfigError
from ...hooked import V1_DPO as DPO_MODULE

NAME, KEY = "liger_fsdp", "kernel_config"
REMOVE = f"remove `{NAME}` from `{KEY}.name`"  # the fix that trains without the plugin
RM_MODULE = "llamafactory.v1.trainers.rm_trainer"  # loaded by `llamafactory-cli rm` before its arguments are parsed
TOP, DIST = "top level", "dist_config"


@functools.lru_cache(maxsize=None)
def spelling() -> str:
    """Where the installed LLaMA-Factory's v1 reads ``cp_size``: :data:`TOP` (git main's ``TrainingArguments`` has
    the field) or :data:`DIST` (0.9.5); by version where v1's arguments cannot be imported here."""
    try:
        from llamafactory.v1.config.training_args import TrainingArguments

        return TOP if "cp_size" in {f.name for f in dataclasses.fields(TrainingArguments)} else DIST
    except Exception:
        found = versions.installed("llamafactory")
        return TOP if found is not None and versions.at_least(found, "0.9.6.dev0") else DIST


def plugin_config(value: Any) -> dict:
    """A v1 ``*_config`` value as a dict (v1 also takes a JSON string)."""
    if isinstance(value, str) and value.strip().startswith("{"):
        value = json.loads(value)
    return dict(value) if isinstance(value, Mapping) else {}


def dist(values: Mapping) -> dict:
    """``dist_config`` as a dict."""
    return plugin_config(values.get("dist_config"))


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


@dataclasses.dataclass(frozen=True)
class Settings:
    """A yaml's CP settings as the installed v1 reads them; ``key``/``mode_key`` name where they are written."""

    size: int
    mode: str
    key: str
    mode_key: str
    other: tuple = ()  # (key, value) written in the spelling the installed v1 does not read


def read(values: Mapping) -> Settings:
    """The run's ``cp_size`` / ``cp_mode`` from the yaml (or the parsed arguments as yaml keys)."""
    inner = dist(values)
    top = {k: values.get(k) for k in ("cp_size", "cp_mode") if values.get(k) is not None}
    there = {k: inner.get(k) for k in ("cp_size", "cp_mode") if inner.get(k) is not None}
    if spelling() == TOP:  # dist_config's are ignored: a problem once they ask for sequence parallelism
        read_, prefix = top, ""
        other = [(f"dist_config.{k}", v) for k, v in there.items()] if _int(there.get("cp_size")) > 1 else []
    else:  # 0.9.5's parser stops on any top-level CP key
        read_, prefix, other = there, "dist_config.", list(top.items())
    return Settings(max(_int(read_.get("cp_size", 1)), 1), str(read_.get("cp_mode") or "ulysses"),
                    f"{prefix}cp_size", f"{prefix}cp_mode", tuple(other))


def as_yaml(size: int, mode: str = "ulysses", dist_name: Any = "fsdp2") -> dict:
    """The yaml keys that ask the installed v1 for ``cp_size: size`` (the fixes' spelling; tests)."""
    if spelling() == TOP:
        return {"dist_config": {"name": dist_name}, "cp_size": size, "cp_mode": mode}
    return {"dist_config": {"name": dist_name, "cp_size": size, "cp_mode": mode}}


def size(values: Mapping) -> int:
    """The yaml's ``cp_size`` as the installed v1 reads it (1 without sequence parallelism)."""
    return read(values).size


def positions_from_one() -> bool:
    """LLaMA-Factory 0.9.5's v1 numbers positions from 1 and pads them with 0 (git main: from 0)."""
    found = versions.installed("llamafactory")
    return found is not None and not versions.at_least(found, "0.9.6.dev0")


def rm_run(command: str | None) -> bool:
    """An RM run (a rank knows its command by the trainer module loaded)."""
    return command == "rm" or (command is None and RM_MODULE in sys.modules)


# --------------------------------------------------------------------------- the refusals, in order
def _spelled_as_installed(command, values, cp: Settings, cfg) -> str | None:
    if not cp.other:
        return None
    key, value = cp.other[0]
    found = versions.installed("llamafactory")
    right = key.split(".")[-1]
    if spelling() == DIST:
        return (f"`{key}: {value}` at the top level of the yaml is LLaMA-Factory git main's spelling; the installed "
                f"{found} reads `{right}` only inside `dist_config` (its parser stops every rank on the unknown key). "
                f"Fix: `dist_config: {{name: fsdp2, {right}: {value}}}` instead of the top-level key.")
    return (f"`{key}: {value}` is LLaMA-Factory 0.9.5's spelling; the installed {found} reads `{right}` only at the "
            f"top level and ignores it inside `dist_config` (the run would train without sequence parallelism). Fix: "
            f"`{right}: {value}` at the top level of the yaml, out of `dist_config`.")


def _dpo_in_installed_v1(command, values, cp: Settings, cfg) -> str | None:
    if command != "dpo" or has_v1_dpo():
        return None
    return (f"`llamafactory-cli dpo` under USE_V1=1: the installed LLaMA-Factory {versions.installed('llamafactory')} "
            f"has no v1 DPO trainer (every rank stops with NotImplementedError, with or without `{NAME}`). Fix: train "
            f"DPO with the default engine (`stage: dpo`, without USE_V1), or install LLaMA-Factory newer than 0.9.5.")


def _ulysses(command, values, cp: Settings, cfg) -> str | None:
    if cp.mode == "ulysses":
        return None
    return (f"`{cp.mode_key}: {cp.mode}` with `{KEY}.name: {NAME}`: the plugin's loss reproduces v1's Ulysses "
            f"sequence parallelism only. Fix: `{cp.mode_key}: ulysses`, or {REMOVE}.")


def _fsdp2(command, values, cp: Settings, cfg) -> str | None:
    name = dist(values).get("name")
    if name == "fsdp2":
        return None
    return (f"`{cp.key}: {cp.size}` with `dist_config.name: {name}` and `{KEY}.name: {NAME}`: the plugin's sequence "
            f"parallelism is exact and tested under v1's FSDP2. Fix: `dist_config: {{name: fsdp2}}`, or {REMOVE}.")


def _flash_attention(command, values, cp: Settings, cfg) -> str | None:
    found = str(values.get("flash_attn") or "sdpa")
    if found == "flash_attention_2":
        return None
    return (f"`{cp.key}: {cp.size}` with `flash_attn: {found}`: LLaMA-Factory's sequence parallelism needs "
            f"`flash_attn: flash_attention_2` and stops every rank before step 1 without it (\"Sequence parallelism "
            f"requires flash attention\"), with or without `{NAME}`. Fix: `flash_attn: flash_attention_2`.")


def _micro_batch(command, values, cp: Settings, cfg) -> str | None:
    micro = values.get("micro_batch_size")
    # RMTrainer numbers the pair rows' positions from 0 itself
    if not ((micro is None or _int(micro) == 1) and positions_from_one() and not rm_run(command)):
        return None
    default, found = " (v1's default)" if micro is None else "", versions.installed("llamafactory")
    return (f"`micro_batch_size: 1`{default} with `{cp.key}: {cp.size}` on LLaMA-Factory {found}: its v1 numbers "
            f"positions from 1 and pads a sequence to a multiple of cp_size with position 0, so a one-row micro-batch "
            f"of a length that is not a multiple looks packed to transformers and trains another objective, with or "
            f"without `{NAME}`. Fix: `micro_batch_size: 2` or more, or a newer LLaMA-Factory.")


def _memory_report_under_rm(command, values, cp: Settings, cfg) -> str | None:
    if not (getattr(cfg, "memory_report", False) and (rm_run(command) or values.get("model_class") == "cls")):
        return None
    return (f"`{KEY}.liger_fsdp_memory_report: true` in an RM run under CP: the plugin gathers the score head's "
            f"scores there and runs no fused vocabulary kernel, so the report has nothing to measure. Fix: remove "
            f"`liger_fsdp_memory_report` from `{KEY}`.")


#: The CP refusals in the order they are checked: each (command, yaml values, :class:`Settings`, the plugin's config
#: or None) -> the message, or None where the setting is taken.
RULES: tuple[Callable[..., str | None], ...] = (
    _spelled_as_installed, _dpo_in_installed_v1, _ulysses, _fsdp2, _flash_attention, _micro_batch,
    _memory_report_under_rm)


@functools.lru_cache(maxsize=None)
def has_v1_dpo() -> bool:
    """Whether the installed v1 has a DPO trainer (0.9.5 ships an empty ``dpo_trainer.py`` and its launcher raises
    NotImplementedError for ``dpo``): its source defines ``run_dpo``, read without importing it (torch-free)."""
    try:
        spec = importlib.util.find_spec(DPO_MODULE)
        if spec is None or not spec.origin:
            return False
        with open(spec.origin, encoding="utf-8") as f:
            return "def run_dpo" in f.read()
    except (ImportError, ValueError, OSError):
        return False


def check(command: str | None, values: Mapping, cfg: Any = None) -> None:
    """Refuse the first CP setting the plugin does not make exact or that cannot train (:data:`RULES`); nothing
    without sequence parallelism, except a spelling the installed v1 does not read and v1 DPO where there is none."""
    cp = read(values)
    rules = RULES if cp.size > 1 else (_spelled_as_installed, _dpo_in_installed_v1)
    for rule in rules:
        problem = rule(command, values, cp, cfg)
        if problem:
            raise LigerFsdpConfigError(problem)


def check_spelling(values: Mapping) -> None:
    """Only the spelling rule (a rank, before v1's parser stops on a key the installed v1 does not have)."""
    problem = _spelled_as_installed(None, values, read(values), None)
    if problem:
        raise LigerFsdpConfigError(problem)


def doctor_line(values: Mapping) -> str | None:
    """What ``doctor`` says of a CP yaml the plugin takes (None without sequence parallelism)."""
    cp = read(values)
    if cp.size <= 1:
        return None
    dpo = ("the policy's and the reference's per-token log-probs from the fused kernel on each shard, gathered across "
           "the CP group, held against DPOTrainer.compute_loss at cp_size 1" if has_v1_dpo() else
           f"not in the installed LLaMA-Factory {versions.installed('llamafactory')} (no v1 DPO trainer; refused)")
    return (f"sequence parallelism: Ulysses, cp_size {cp.size} (`{cp.key}`): v1's sequence_parallel_loss from the fused kernel "
            f"on each rank's 1/{cp.size} of every sequence (no [N/{cp.size}, V] logits), held against v1's own on the "
            f"first step; `llamafactory-cli rm`: the score head's scores of each shard gathered across the CP group, "
            f"held against RMTrainer.compute_loss at cp_size 1; `llamafactory-cli dpo`: {dpo}.")
