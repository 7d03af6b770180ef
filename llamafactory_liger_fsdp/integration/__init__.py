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

torch, always (:mod:`.launch`): ``torch.distributed.run.run`` -- a bare ``torchrun`` checks them too, and every
launching process prints a refusal or guard stop of its ranks last (:mod:`.stop`) (the ranks hand it over, :func:`.stop.install_in_rank`
when the parser loads).

Nothing here may break the import of the module it hooks: any exception while hooking one (not only
:class:`.._patch.PatchError`) leaves LLaMA-Factory as installed and says in one line that the plugin is unavailable.

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

import sys

from .. import _patch
from ..hooked import (ACCELERATE_LAUNCH, LAUNCHER, LOADER, MODULES, PARSER, TORCHRUN, V1_KERNELS, V1_LAUNCHER,
                      V1_PARSER)


_SAID: set = set()  # "unavailable" said in this process


def unavailable(name: str, exc: BaseException) -> None:
    """The one line of a hook that failed (the first in a process; rank 0): LLaMA-Factory runs as installed."""
    import os

    if _SAID or os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) not in ("", "0"):
        return
    _SAID.add(name)
    why = str(exc) if isinstance(exc, _patch.PatchError) else f"{type(exc).__name__}: {exc}"
    print(f"[liger_fsdp] unavailable: cannot hook {name} ({why}); LLaMA-Factory runs as installed, without the "
          "plugin (a yaml with `liger_fsdp` keys is rejected by its parser). Fix: install the plugin's tested "
          "versions (`python -m llamafactory_liger_fsdp env`), and report this line.", file=sys.stderr, flush=True)


def on_module_loaded(name: str, module: Any) -> None:
    """Called by the import hook right after a hooked module has executed: the parser, loader and launchers are
    hooked in every process (the keys must parse); the preference trainers are patched later, only by a run of their
    stage (:func:`.preference.patch_stage`). Never raises (:func:`unavailable`)."""
    if name not in MODULES:
        return
    try:
        from . import launch, llamafactory, stop
        from .v1 import engine as v1

        patchers = {PARSER: llamafactory.patch_parser, LOADER: llamafactory.patch_loader,
                    LAUNCHER: launch.patch_launcher, V1_LAUNCHER: v1.patch_v1_launcher,
                    V1_PARSER: v1.patch_v1_parser, V1_KERNELS: v1.patch_v1_kernels,
                    ACCELERATE_LAUNCH: launch.patch_accelerate_launch, TORCHRUN: launch.patch_torchrun}
        patchers[name](module)
        if name in (PARSER, V1_PARSER):  # a LLaMA-Factory run in this process: a rank hands its stop over
            stop.install_in_rank()
    except Exception as exc:  # never break the import of the hooked module
        unavailable(name, exc)


def unpatch() -> None:
    """Undo every patch (tests; a process that wants LLaMA-Factory back as installed)."""
    _patch.undo_all()
