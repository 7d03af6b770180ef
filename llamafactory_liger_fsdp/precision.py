"""DeepSpeed ZeRO-3 with a bf16/fp16 model: trainable parameters in the compute dtype, as DeepSpeed casts them itself.

Under ZeRO-0/1/2 (and ZeRO-3 without ``zero.init``) DeepSpeed's bf16/fp16 mode casts every parameter of the module
to that dtype at ``deepspeed.initialize`` (``_cast_module_mixed_precision``) and keeps fp32 master weights in its
optimizer. Under ZeRO-3 with ``zero.init`` -- how LLaMA-Factory loads the model -- it skips that cast, so PEFT's LoRA
weights stay fp32 while the ``modules_to_save`` copies (``additional_target: embed_tokens,lm_head``) are bf16, and the
ZeRO-3 optimizer stops before step 1 (``assert len(set(t.dtype for t in tensors)) == 1`` in ``defragment``), with or
without a fused loss.

:func:`to_compute_dtype` makes ZeRO-3 do what the other stages do: the trainable parameters in the compute dtype
(the frozen weights' dtype), the fp32 masters in DeepSpeed's optimizer. The head and the embedding then compute in
that dtype, as under FSDP's mixed precision (fp32 copies made the 128k-vocabulary head GEMM fp32: 4.8x slower on an
H200, bench/RESULTS.md). Applied only once the plugin engaged, right after LLaMA-Factory's ``load_model`` (the PEFT
parameters are still plain tensors on every rank; ``deepspeed.initialize`` partitions them later); the returned undo
casts them back for :func:`..engage.disengage`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import thirdparty


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype most frozen floating parameters have (the model's compute dtype), None without frozen ones."""
    frozen = [p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    return max(set(frozen), key=frozen.count) if frozen else None


def to_compute_dtype(model: nn.Module) -> tuple[str | None, Callable[[], None] | None]:
    """Cast trainable parameters to the compute dtype when their dtypes are mixed (what ZeRO-3's optimizer cannot
    take) and the compute dtype is 16-bit; (a description for the log, the undo), or (None, None)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    dtype = compute_dtype(model)
    if len({p.dtype for _, p in trainable}) <= 1 or dtype not in (torch.bfloat16, torch.float16):
        return None, None
    cast: list[tuple[torch.nn.Parameter, torch.dtype]] = []
    counts: dict[torch.dtype, int] = {}
    for name, p in trainable:
        if p.dtype == dtype or not p.is_floating_point():
            continue
        if thirdparty.is_zero3_param(p):  # never seen: PEFT's parameters exist before deepspeed.initialize
            raise RuntimeError(f"liger_fsdp: {name} is already partitioned by ZeRO-3; cannot change its dtype")
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        cast.append((p, p.dtype))
        p.data = p.data.to(dtype)

    def undo() -> None:
        for p, old in cast:
            p.data = p.data.to(old)

    what = ", ".join(f"{n:,} {str(d).replace('torch.', '')}" for d, n in counts.items())
    return (f"{len(cast)} trainable parameter tensor(s) ({what} values) -> {str(dtype).replace('torch.', '')}", undo)
