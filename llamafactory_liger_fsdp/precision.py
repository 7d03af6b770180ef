"""DeepSpeed ZeRO-3 with a bf16/fp16 model: one dtype for the trainable parameters.

LLaMA-Factory builds the model under ``zero.init()`` in bf16 and skips its own fp32 upcast of trainable
parameters under ZeRO-3 ("remaining trainable params in float32"), but PEFT makes the LoRA weights fp32 while the
``modules_to_save`` copies (``additional_target: embed_tokens,lm_head``) stay bf16. DeepSpeed's ZeRO-3 optimizer then
stops before step 1: ``assert len(set(t.dtype for t in tensors)) == 1`` in ``zero/utils.py defragment``.

:func:`unify_trainable_dtype` does what LLaMA-Factory does outside ZeRO-3: trainable copies in fp32 (DeepSpeed keeps
its fp32 master partitions as well). DeepSpeed's bf16 mode runs no autocast, so each module whose weights were cast
becomes an fp32 island: its floating inputs are cast to fp32 and its floating outputs back to the model's dtype (the
embedding's output meets bf16 decoder layers; the head's logits leave as a bf16 model's would). Outputs of a call
redirected by :mod:`.gather` (the fused loss itself) are left in fp32. The copies are still plain tensors on every
rank at this point (PEFT creates them after ``zero.init``); ``deepspeed.initialize`` partitions them afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from . import gather, thirdparty


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def _island(module: nn.Module, compute: torch.dtype) -> None:
    def pre(mod, args, kwargs):
        return _cast(args, torch.float32), {k: _cast(v, torch.float32) for k, v in kwargs.items()}

    def post(mod, args, output):
        return output if gather.is_redirected(mod) else _cast(output, compute)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)


def unify_trainable_dtype(model: nn.Module) -> str | None:
    """Cast the low-precision trainable parameters to fp32 when fp32 ones exist too; a description, or None."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len({p.dtype for p in trainable}) <= 1 or torch.float32 not in {p.dtype for p in trainable}:
        return None
    frozen = [p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    compute = max(set(frozen), key=frozen.count) if frozen else torch.bfloat16
    owners, numel = [], 0
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and p.dtype != torch.float32]
        if not own:
            continue
        for p in own:
            if thirdparty.is_zero3_param(p):  # never seen: PEFT's copies exist before deepspeed.initialize
                raise RuntimeError(f"liger_fsdp: {name} is already partitioned by ZeRO-3; cannot change its dtype")
            p.data = p.data.float()
            numel += p.numel()
        _island(module, compute)
        owners.append(name)
    return (f"{len(owners)} module(s) ({', '.join(owners)}), {numel:,} parameters: {compute} -> float32, "
            f"+{numel * 2 / 2**30:.2f} GiB before partitioning")
