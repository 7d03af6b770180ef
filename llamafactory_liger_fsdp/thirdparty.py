"""Third-party types the plugin recognises, by identity (``isinstance``), each imported once.

Nothing is imported at package import time (the ``.pth`` hook must not import torch): each group is
imported on first use and cached. DeepSpeed marks a ZeRO-3 parameter with ``ds_*`` attributes on a
plain ``nn.Parameter`` (it has no class of its own), so that one is recognised by attribute.
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _peft() -> tuple | None:
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # the plugin works without PEFT (full fine-tuning)
        return None
    return PeftModel, LoraLayer, ModulesToSaveWrapper


@cache
def _torch_distributed() -> tuple:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter
    from torch.distributed.tensor import DTensor

    return FullyShardedDataParallel, FSDPModule, FlatParameter, DTensor


def is_peft_model(obj: Any) -> bool:
    types = _peft()
    return types is not None and isinstance(obj, types[0])


def is_lora_layer(obj: Any) -> bool:
    types = _peft()
    return types is not None and isinstance(obj, types[1])


def is_modules_to_save(obj: Any) -> bool:
    types = _peft()
    return types is not None and isinstance(obj, types[2])


def is_fsdp1(obj: Any) -> bool:
    return isinstance(obj, _torch_distributed()[0])


def is_fsdp2(obj: Any) -> bool:
    return isinstance(obj, _torch_distributed()[1])


def is_flat_param(obj: Any) -> bool:
    return isinstance(obj, _torch_distributed()[2])


def is_dtensor(obj: Any) -> bool:
    return isinstance(obj, _torch_distributed()[3])


def is_module_wrapper(obj: Any) -> bool:
    """DDP or a DeepSpeed engine: the model is its ``.module`` (an engine exists only once deepspeed is imported)."""
    import sys

    from torch.nn.parallel import DistributedDataParallel

    if isinstance(obj, DistributedDataParallel):
        return True
    engine = sys.modules.get("deepspeed.runtime.engine")
    return engine is not None and isinstance(obj, engine.DeepSpeedEngine)


def is_zero3_param(obj: Any) -> bool:
    """A parameter partitioned by DeepSpeed ZeRO-3 (``deepspeed.runtime.zero.partition_parameters``)."""
    return hasattr(obj, "ds_id") and hasattr(obj, "ds_status")


def is_causal_lm_loss(fn: Any) -> bool:
    """``fn`` is transformers' own ``ForCausalLMLoss`` (what the fused loss reproduces)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return fn is ForCausalLMLoss


@cache
def _hf_args() -> tuple:
    from llamafactory.hparams import DataArguments, FinetuningArguments, ModelArguments
    from transformers import TrainingArguments

    return ModelArguments, DataArguments, TrainingArguments, FinetuningArguments


def parsed_args(result: Any) -> dict[str, Any]:
    """LLaMA-Factory's parsed dataclasses by role: ``{"model", "data", "training", "finetuning"}``."""
    roles = dict(zip(("model", "data", "training", "finetuning"), _hf_args()))
    found: dict[str, Any] = {}
    for item in result if isinstance(result, (tuple, list)) else ():
        for role, cls in roles.items():
            if role not in found and isinstance(item, cls):
                found[role] = item
    return found
