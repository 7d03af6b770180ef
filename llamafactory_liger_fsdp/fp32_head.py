"""The first-step guard's like-for-like comparison: the model's own output embedding computed in fp32 from the
16-bit operands it would have had.

:class:`Fp32Head` is a ``TorchFunctionMode`` the guard enters for the duration of the output embedding's call: every
``F.linear`` runs in fp32 from its (autocast-cast) operands -- on CUDA with an fp32-output matmul of the 16-bit values,
no fp32 copy of a [V, H] weight -- and whatever is computed from those fp32 results is kept out of 16-bit casts
(PEFT's ``result.to(dtype)``, FSDP2's ``output_dtype``). Those results are tracked by an attribute on every tensor
computed from them, so the sharding library's own casts of parameters (FSDP2 casting a shard to ``param_dtype`` for
its all-gather) are left alone.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .ops.upcast import to_fp32

TAINT = "_liger_fsdp_guard_fp32"


def _tainted(values) -> bool:
    return any(getattr(v, TAINT, False) for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))


class Fp32Head(TorchFunctionMode):
    """Inside the output embedding's call: ``F.linear`` in fp32 from its (autocast-cast) operands, and what is computed
    from those fp32 results is never rounded to 16 bits (PEFT's ``result.to(dtype)``, FSDP2's ``output_dtype`` cast).
    Those results are tracked (an attribute on every tensor computed from them), so the sharding library's own casts
    of parameters (FSDP2 casting a shard to ``param_dtype`` for its all-gather) are left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            out = _linear_fp32(*args, **kwargs)
            setattr(out, TAINT, True)
            return out
        tainted = _tainted((args, kwargs))
        if tainted and func in _CASTS and args[0].dtype == torch.float32 and \
                _target_dtype(func, args[1:], kwargs) in (torch.bfloat16, torch.float16):
            return args[0]
        out = func(*args, **kwargs)
        if tainted:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    setattr(value, TAINT, True)
        return out


_CASTS = (torch.Tensor.to, torch.Tensor.type, torch.Tensor.bfloat16, torch.Tensor.half)


def _target_dtype(func, args, kwargs):
    if func is torch.Tensor.bfloat16:
        return torch.bfloat16
    if func is torch.Tensor.half:
        return torch.float16
    for value in (*args, kwargs.get("dtype")):
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, torch.Tensor):
            return value.dtype
    return None


def _linear_fp32(x, weight, bias=None):
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # the operands the layer would have had
        dtype = torch.get_autocast_dtype(dev)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(dev, enabled=False):
        if x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
            out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
            out = out.reshape(*x.shape[:-1], weight.shape[0])
        else:
            out = torch.nn.functional.linear(*to_fp32(x, weight))
        return out if bias is None else out + bias.float()


class HeadCalls:
    """For its duration every call of ``causal_lm``'s output embedding runs under :class:`Fp32Head`; counts the calls
    and keeps the first call's input dtype (what the guard's bound depends on). Zero calls: the forward computed its
    logits without calling the output embedding as a module, in its own precision. With ``window`` each call's input
    is cut to those rows and positions first."""

    def __init__(self, causal_lm: torch.nn.Module, window: tuple | None = None):
        self.head, self.window = causal_lm.get_output_embeddings(), window  # (rows or None, start, end)
        self.calls, self.dtype, self._depth, self._mode, self._handles = 0, None, 0, None, []

    def _enter(self, module, args):
        self.calls += 1
        if self.dtype is None and args and isinstance(args[0], torch.Tensor):
            self.dtype = args[0].dtype
        if self._depth == 0:
            self._mode = Fp32Head()
            self._mode.__enter__()
        self._depth += 1
        if self.window is not None and self._depth == 1:  # the head's input cut to the window: logits for it only
            rows, start, end = self.window
            return (args[0][slice(None) if rows is None else rows][:, start:end], *args[1:])
        return None

    def _leave(self, *_):
        if self._depth:
            self._depth -= 1
            if self._depth == 0:
                self._mode.__exit__(None, None, None)

    def __enter__(self) -> "HeadCalls":
        self._handles = [self.head.register_forward_pre_hook(self._enter),
                         self.head.register_forward_hook(self._leave, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        while self._depth:
            self._leave()
