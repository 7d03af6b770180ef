"""Opt-in diagnostics (``liger_fsdp_memory_report: true``): the memory the fused kernel really used.

:class:`LiveBytes` is a ``TorchDispatchMode`` that counts the bytes of every tensor storage created while
it is active and still alive, and keeps the peak: the working memory of the code it wraps, on any
device, without touching CUDA's global peak-memory counters (which the Trainer's memory metrics and
users' profilers read). :class:`MemoryReport` wraps the kernel call on the first training step (rank 0)
and logs its forward and backward working memory beyond the gradients it returns.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._log import info_rank0

GIB = 2**30


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated inside the ``with`` block (inputs and views not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self._known: dict[int, StorageWeakRef] = {}  # storages that existed before (seen as inputs)
        self._mine: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._mine.items() if ref.expired()]:
            self.live -= self._mine.pop(key)[1]
        for key in [k for k, ref in self._known.items() if ref.expired()]:
            del self._known[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self._mine:
                    self._known.setdefault(ref.cdata, ref)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self._mine and ref.cdata not in self._known:
                    self._mine[ref.cdata] = (ref, storage.nbytes())
                    self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        return out


class _Measured(torch.autograd.Function):
    """Runs ``kernel`` on detached inputs under :class:`LiveBytes`, forward and backward (the backward as
    one nested ``autograd.grad`` inside this node, so the dispatch mode covers exactly the kernel's own)."""

    @staticmethod
    def forward(ctx, h, w, y, kernel, report, kw):
        h_in, w_in = h.detach().requires_grad_(h.requires_grad), w.detach().requires_grad_(w.requires_grad)
        with torch.enable_grad(), LiveBytes() as live:
            loss = kernel(h_in, w_in, y, **kw)
        report.peaks["forward"] = live.peak
        ctx.inner = (loss, h_in, w_in, report)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        loss, h_in, w_in, report = ctx.inner
        del ctx.inner
        wanted = [t for t in (h_in, w_in) if t.requires_grad]
        with LiveBytes() as live:
            grads = list(torch.autograd.grad(loss, wanted, grad))
        returned = sum(g.numel() * g.element_size() for g in grads)
        report.peaks["backward"] = max(live.peak - returned, 0)
        report.log()
        out = [grads.pop(0) if t.requires_grad else None for t in (h_in, w_in)]
        return out[0], out[1], None, None, None, None


class MemoryReport:
    """Measures one kernel call (forward and backward) and logs it once (rank 0)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.peaks: dict[str, int] = {}
        self.tokens = 0
        self.logged = False

    def __call__(self, kernel, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, **kw):
        """``kw``: the kernel's non-differentiable extras (``frozen_weight``), passed on."""
        self.tokens = int(h.shape[0])
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            return _Measured.apply(h, w, y, kernel, self, kw)
        with LiveBytes() as live:
            loss = kernel(h, w, y, **kw)
        self.peaks["forward"] = live.peak
        self.log()
        return loss

    def log(self) -> None:
        if self.logged:
            return
        self.logged = True
        parts = ", ".join(f"{k} {_size(v)}" for k, v in self.peaks.items())
        info_rank0(
            f"[liger_fsdp] memory (step 1, measured): the fused loss kernel used {_size(max(self.peaks.values()))} "
            f"beyond its inputs and gradients ({parts}); the unfused logits of these {self.tokens} tokens would need "
            f"at least {_size(self.tokens * self.vocab * 10)} (vocab {self.vocab}, 10 bytes a logit)."
        )
