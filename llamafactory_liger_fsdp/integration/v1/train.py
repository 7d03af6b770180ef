"""The v1 engine's patches made once a model engaged (:func:`.v1.engage_v1`), recorded on the model and undone by
:func:`...engage.disengage` (v1's ``DPOTrainer`` in a DPO run: :mod:`.v1_dpo`):

* ``llamafactory.v1.core.base_trainer.BaseTrainer.compute_log_probs`` -- every v1 trainer's ``logits.float()`` +
  ``cross_entropy(reduction="none")``, answered by :func:`...forward.token_logps` (the loss seam's per-row kernel,
  through the head's units). The inputs are the original method's own: it runs with a stand-in model that records
  them (device moves, git main's mRoPE ``position_ids`` pop). On the first training call the original method, run on a
  slice of the batch with the model's own forward, is held against the replacement (:mod:`...guard`).
* ``llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2.fully_shard`` (FSDP2 only) -- before a module is
  sharded, its tagged head modules that are not units yet become units: a full/freeze head and a LoRA head's
  ``base_layer`` (v1 already makes every trainable leaf a unit under LoRA, a ``modules_to_save`` head included); a
  module that is a unit already is left as it is (v1 itself shards an untied ``modules_to_save: [embed_tokens]`` copy
  twice and stops on the second call, with or without the plugin).
"""

from __future__ import annotations

from typing import Any

from ... import _patch, thirdparty, wrapping
from ..._log import info_rank0
from . import args as v1_args


class Captured(Exception):
    pass


class Recorder:
    """A stand-in model: records the keyword arguments a trainer method calls it with (v1's ``compute_log_probs``,
    ``RMTrainer.compute_loss``), then stops the method (:class:`Captured`)."""

    kwargs: dict | None = None

    def __call__(self, *args: Any, **kwargs: Any):
        self.kwargs = dict(kwargs) if not args else None
        raise Captured


def unwrapped(model: Any) -> Any:
    """The model inside DDP or a DeepSpeed engine (FSDP2 keeps the model object)."""
    while thirdparty.is_module_wrapper(model):
        model = model.module
    return model


def patch_compute_log_probs() -> list:
    from llamafactory.v1.core import base_trainer

    from ... import engage, forward, guard

    cls = base_trainer.BaseTrainer
    _patch.require_params(cls.compute_log_probs, ("self", "model", "batch"), "BaseTrainer.compute_log_probs")

    def make(original):
        def fused(self, model, inner, batch):
            recorder = Recorder()
            try:
                original(self, recorder, batch)
            except Captured:
                pass
            if not recorder.kwargs or "labels" not in recorder.kwargs:
                raise _patch.PatchError("v1's compute_log_probs no longer calls model(**inputs) with labels; "
                                        f"Fix: {v1_args.REMOVE} and report your LLaMA-Factory version.")
            inputs = recorder.kwargs
            labels = inputs.pop("labels")
            logps, _, _ = forward.token_logps(model, engage.causal_lm_of(inner), inputs, labels, sums=False,
                                              step=getattr(self, "global_step", None))
            return logps

        def compute_log_probs(self, model, batch):
            inner = unwrapped(model)
            if engage.engaged(inner) is None:
                return original(self, model, batch)
            causal_lm = engage.causal_lm_of(inner)
            check = guard.Check("LLaMA-Factory's BaseTrainer.compute_log_probs", lambda b: original(self, model, b),
                                lambda b: fused(self, model, inner, b), lambda a, b: {"per-token log-probs": (a, b)},
                                models=(causal_lm,))
            guard.first_call(causal_lm, engage.engaged(inner).family, check, batch, batch["labels"],
                             step=getattr(self, "global_step", None))
            return fused(self, model, inner, batch)

        return compute_log_probs

    patch = _patch.apply(cls, "compute_log_probs", make, "v1: per-token log-probs from the fused kernel, no [N, V] "
                                                         "logits")
    return [] if patch is None else [lambda: _patch.undo(cls, "compute_log_probs")]


def patch_fully_shard() -> list:
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    said = []

    def make(original):
        def fully_shard(module, *args: Any, **kwargs: Any):
            if thirdparty.is_fsdp2(module):  # v1 shards a trainable nn.Embedding twice (its LoRA leaf loop, then
                if not said:                  # its embedding rule): the second call would raise; the unit exists
                    said.append(True)
                    info_rank0(f"[liger_fsdp] v1 FSDP2: {type(module).__name__} is already a unit (v1's LoRA leaf loop "
                               "and its embedding rule both shard an untied trainable embedding); left as it is.")
                return module
            wrapping.shard_marked_units(module, shard=lambda sub, **kw: original(sub, *args, **kw), below_only=True,
                                        **kwargs)
            return original(module, *args, **kwargs)

        return fully_shard

    patch = _patch.apply(fsdp2, "fully_shard", make, "v1 FSDP2: the head modules become units of their own")
    return [] if patch is None else [lambda: _patch.undo(fsdp2, "fully_shard")]
