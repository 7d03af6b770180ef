"""Every point where the plugin touches third-party code, grouped by what it patches. Each patch is guarded by a
signature check, recorded in :mod:`.._patch`, logged once on rank 0 when the flag is on, and undone by
:func:`unpatch`.

LLaMA-Factory, always (:mod:`.llamafactory`, patched by the import hook right after each module executes):

* ``llamafactory.hparams.parser._parse_args`` -- takes the ``liger_fsdp*`` keys out before
  ``HfArgumentParser`` sees them, validates them, decides the run's sharding once and runs the
  refusals (:mod:`..refusals`); hangs the config on ``FinetuningArguments``.
* ``llamafactory.hparams.parser.get_train_args`` -- never resume from a half-written checkpoint.
* ``llamafactory.model.loader.load_model`` -- after LLaMA-Factory built the (PEFT) model,
  :func:`..engage.engage` sets the fused forward and tags the head's FSDP units.
* ``llamafactory.launcher.launch`` -- ``llamafactory-cli train``'s launching process checks what the
  arguments alone decide before any rank starts (one error, printed once, last; :mod:`.launch`).

accelerate's CLI, always (:mod:`.launch`): ``accelerate.commands.launch.launch_command`` -- ``accelerate launch``
checks the training script's arguments the same way before it starts any process.

LLaMA-Factory's v1 engine (``USE_V1=1``; :mod:`.v1.engine`): its launcher (the same check), its ``get_args`` and its kernel
registry (entry ``liger_fsdp``); once engaged (:mod:`.v1.train`), ``BaseTrainer.compute_log_probs`` and, under FSDP2,
its ``fully_shard``; in a DPO run v1's ``DPOTrainer`` (:mod:`.v1.dpo`).

The other groups are patched by :func:`.llamafactory.engage_model` only when this run needs it, recorded on the
engaged model and undone by :func:`..engage.disengage`:

accelerate (:mod:`.accelerate`, once a model engaged under FSDP1 or FSDP2, that version's function only):

* ``FullyShardedDataParallelPlugin.set_auto_wrap_policy`` (FSDP1) or
  ``fsdp_utils.fsdp2_prepare_auto_wrap_policy`` (FSDP2) -- the tagged head modules become units.

transformers (:mod:`.trainer`):

* ``transformers.trainer.save_fsdp_model`` / ``load_fsdp_model`` -- FSDP2 + adapter, where the installed accelerate
  needs it (:mod:`..checkpoint.repair`), whether or not the loss engages.
* ``transformers.Trainer.__init__`` -- only with ``label_smoothing_factor > 0``: the kernel smooths, the labels stay.

LLaMA-Factory's preference trainers (:mod:`.preference`, a DPO or KTO run, its own stage's only):

* ``CustomDPOTrainer.concatenated_forward`` and ``CustomKTOTrainer.forward`` -- log-probs from the fused kernel.

Liger-Kernel: with ``enable_liger_kernel: true`` LLaMA-Factory still applies Liger's kernels (RMSNorm,
RoPE, SwiGLU); Liger's fused loss lives in the *class* ``forward`` it installs, ours is set on the
*instance*, so in training Liger's fused loss is never called.
"""

from __future__ import annotations

from typing import Any

from .. import _patch
from .._log import info_rank0
from ..hooked import ACCELERATE_LAUNCH, LAUNCHER, LOADER, MODULES, PARSER, V1_KERNELS, V1_LAUNCHER, V1_PARSER


def on_module_loaded(name: str, module: Any) -> None:
    """Called by the import hook right after a hooked LLaMA-Factory module has executed: the parser, loader and
    launcher are hooked in every process (the keys must parse); the preference trainers are patched later, only
    by a run of their stage (:func:`.preference.patch_stage`)."""
    if name not in MODULES:
        return
    from . import launch, llamafactory
    from .v1 import engine as v1

    patchers = {PARSER: llamafactory.patch_parser, LOADER: llamafactory.patch_loader,
                LAUNCHER: launch.patch_launcher, V1_LAUNCHER: v1.patch_v1_launcher,
                V1_PARSER: v1.patch_v1_parser, V1_KERNELS: v1.patch_v1_kernels,
                ACCELERATE_LAUNCH: launch.patch_accelerate_launch}
    try:
        patchers[name](module)
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] cannot hook {name}: {exc}; `liger_fsdp` is unavailable in this environment")


def unpatch() -> None:
    """Undo every patch (tests; a process that wants LLaMA-Factory back as installed)."""
    _patch.undo_all()
