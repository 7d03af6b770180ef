"""What the plugin takes of v1's sequence parallelism (``cp_size > 1``), decided from the yaml alone (the launching
process and every rank, through :func:`.v1_args.check`). Imports no torch.

Exact and tested (:mod:`.cp`, :mod:`.cp_rm`, :mod:`.cp_dpo`): SFT, RM and DPO, Ulysses, v1's FSDP2 (0.9.5's ``dist_config: {name: fsdp2,
cp_size, cp_mode}``, git main's top-level ``cp_size`` / ``cp_mode``). Everything else under CP is refused here, once,
before the ranks start.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ... import versions
from ...config import LigerFsdpConfigError

NAME, KEY = "liger_fsdp", "kernel_config"
FIX_REMOVE = f"or remove `{NAME}` from `{KEY}.name`"
RM_MODULE = "llamafactory.v1.trainers.rm_trainer"  # loaded by `llamafactory-cli rm` before its arguments are parsed


def _dist(values: Mapping) -> dict:
    value = values.get("dist_config")
    return dict(value) if isinstance(value, Mapping) else {}


def _first(values: Mapping, key: str, default: Any) -> Any:
    """A CP key as git main (top level) or 0.9.5 (inside ``dist_config``) spells it."""
    value = values.get(key)
    return value if value not in (None, default) else _dist(values).get(key, default)


def positions_from_one() -> bool:
    """LLaMA-Factory 0.9.5's v1 numbers positions from 1 and pads them with 0 (git main: from 0)."""
    found = versions.installed("llamafactory")
    return found is not None and not versions.at_least(found, "0.9.6.dev0")


def check(command: str | None, values: Mapping, size: int) -> None:
    """Refuse every sequence-parallel setting the plugin does not make exact (``size`` = the run's ``cp_size``)."""
    key = "cp_size" if values.get("cp_size") not in (None, 1) else "dist_config.cp_size"
    mode = str(_first(values, "cp_mode", "ulysses"))
    if mode != "ulysses":
        mode_key = "cp_mode" if values.get("cp_mode") not in (None, "ulysses") else "dist_config.cp_mode"
        raise LigerFsdpConfigError(
            f"`{mode_key}: {mode}` with `{KEY}.name: {NAME}`: the plugin's loss reproduces v1's Ulysses sequence "
            f"parallelism only. Fix: `{mode_key}: ulysses`, {FIX_REMOVE}.")
    dist = _dist(values).get("name")
    if dist != "fsdp2":
        raise LigerFsdpConfigError(
            f"`{key}: {size}` with `dist_config.name: {dist}` and `{KEY}.name: {NAME}`: the plugin's sequence "
            f"parallelism is exact and tested under v1's FSDP2. Fix: `dist_config: {{name: fsdp2}}`, {FIX_REMOVE}.")
    micro = values.get("micro_batch_size")
    # RMTrainer numbers the pair rows' positions from 0 itself (a rank knows its command by the trainer module loaded)
    rm = command == "rm" or (command is None and RM_MODULE in sys.modules)
    if (micro is None or int(micro) == 1) and positions_from_one() and not rm:
        default, found = " (v1's default)" if micro is None else "", versions.installed("llamafactory")
        raise LigerFsdpConfigError(
            f"`micro_batch_size: 1`{default} with `{key}: {size}` on LLaMA-Factory {found}: its "
            f"v1 numbers positions from 1 and pads a sequence to a multiple of cp_size with position 0, so a one-row "
            f"micro-batch of a length that is not a multiple looks packed to transformers and trains another "
            f"objective, with or without `{NAME}`. Fix: `micro_batch_size: 2` or more, or a newer LLaMA-Factory.")


def doctor_line(values: Mapping, size: int) -> str:
    """What ``doctor`` says of a CP yaml the plugin takes."""
    line = (f"sequence parallelism: Ulysses, cp_size {size}: v1's sequence_parallel_loss from the fused kernel on each "
            f"rank's 1/{size} of every sequence (no [N/{size}, V] logits), held against v1's own on the first step; "
            f"`llamafactory-cli rm`: the score head's scores of each shard gathered across the CP group, held against "
            f"RMTrainer.compute_loss at cp_size 1; `llamafactory-cli dpo`: the policy's and the reference's per-token "
            f"log-probs from the fused kernel on each shard, gathered across the CP group, held against "
            f"DPOTrainer.compute_loss at cp_size 1.")
    if values.get("flash_attn") != "flash_attention_2":
        line += (" LLaMA-Factory needs `flash_attn: flash_attention_2` for cp_size > 1 (it stops before step 1 "
                 "without it).")
    return line
