"""Shared helpers of the kernel tests: a float64 reference through ``F.cross_entropy``, inputs,
plain torch in the input dtype, and what the kernel allocates (the relative error is
``llamafactory_liger_fsdp.testing.rel``)."""

import torch
import torch.nn.functional as F


def _loss(z, y, ignore_index, reduction, label_smoothing, grad_rows):
    """F.cross_entropy, except that "mean" over zero valid rows is 0 (the kernel's convention);
    with ``grad_rows`` ("none") the scalar is sum_i grad_rows_i * loss_i."""
    per_row = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if reduction == "none":
        return per_row, (per_row * grad_rows).sum()
    if reduction == "sum":
        loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing)
    elif bool((y != ignore_index).any()):
        loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="mean", label_smoothing=label_smoothing)
    else:
        loss = per_row.sum()
    return loss, loss


def reference(h, w, y, ignore_index=-100, reduction="mean", softcap=None, label_smoothing=0.0, grad_rows=None):
    """(loss, dh, dw) in float64 from the given (low-precision) inputs; ``grad_rows`` weights the
    per-row losses of reduction "none" (default all ones)."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = h64 @ w64.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    g = None if grad_rows is None else grad_rows.double()
    if reduction == "none" and g is None:
        g = torch.ones(y.shape[0], dtype=torch.float64)
    loss, scalar = _loss(z, y, ignore_index, reduction, label_smoothing, g)
    scalar.backward()
    return loss.detach(), h64.grad, w64.grad


def plain_torch(h, w, y, ignore_index=-100, reduction="mean", softcap=None, label_smoothing=0.0, grad_rows=None):
    """(loss, dh, dw) of the unfused model in the inputs' dtype: logits out of one matmul in that
    dtype, upcast to fp32 for the loss (what transformers does)."""
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    z = (hh @ ww.t()).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    g = None if grad_rows is None else grad_rows.float()
    if reduction == "none" and g is None:
        g = torch.ones(y.shape[0])
    loss, scalar = _loss(z, y, ignore_index, reduction, label_smoothing, g)
    scalar.backward()
    return loss.detach(), hh.grad, ww.grad


def inputs(n, h, v, dtype, seed=0, ignore=0.25, scale=1.0):
    """hidden [n, h], weight [v, h] (logits of std ~``scale``), labels with ~``ignore`` of -100."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale / h**0.25).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.25).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignore] = -100
    return hidden, weight, y


def run(fn, h, w, y, grad_rows=None, **kw):
    """loss and grads of ``fn(h, w, y, **kw)``; reduction "none" is backpropagated with ``grad_rows``."""
    h.grad = w.grad = None
    loss = fn(h, w, y, **kw)
    if loss.dim() == 0:
        loss.backward()
    else:
        loss.backward(torch.ones_like(loss) if grad_rows is None else grad_rows.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


class StorageTrace:
    """Bytes of tensor storages allocated by aten ops while active and still alive: sampled after
    every op; ``peak(exclude)`` is the largest sample without the storages of ``exclude``. (The
    package's ``diagnostics.LiveBytes`` keeps only the running peak, for the memory report; this
    trace keeps every sample, what was allocated, and pauses, for the kernel's memory tests.)

    ``emulate_gpu(monkeypatch, module)`` removes two CPU-only effects: the kernel's GEMM helpers
    stand in for CUDA's mixed-dtype GEMM with upcast copies the GPU never makes (hidden by
    ``paused()``, so only their fp32 outputs count; it also counts their flops), and the Triton
    interpreter keeps each launch's arguments in a reference cycle until the next garbage
    collection (collected after every launch). ``allocated`` lists every new storage's op and shape."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not tracker._paused and func.overloadpacket is not torch.ops.aten.set_:
                    tracker._record(func, args, kwargs, out)
                return out

        self._mode = _Mode()
        self._refs = {}
        self._samples = []
        self._paused = 0
        self.mm_flops = 0
        self.allocated = []

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def _record(self, func, args, kwargs, out):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        ins = {
            (t.untyped_storage() if isinstance(t, torch.Tensor) else t).data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, (torch.Tensor, torch.UntypedStorage))
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in ins:
                continue
            ref = StorageWeakRef(st)
            old = self._refs.get(ref.cdata)
            if old is None or old[0].expired():
                self._refs[ref.cdata] = (ref, st.nbytes(), f"{func.overloadpacket}{tuple(t.shape)}")
                self.allocated.append((str(func.overloadpacket), tuple(t.shape), t.dtype))
        for k in [k for k, (r, *_) in self._refs.items() if r.expired()]:
            del self._refs[k]
        self._samples.append({k: (n, what) for k, (_, n, what) in self._refs.items()})

    def peak(self, exclude=(), what=False):
        """Largest live total without ``exclude``'s storages; with ``what``, also what was live then."""
        from torch.multiprocessing.reductions import StorageWeakRef

        skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude if t is not None}
        best, live = 0, []
        for s in self._samples:
            total = sum(n for k, (n, _) in s.items() if k not in skip)
            if total > best:
                best, live = total, [f"{w}: {n}" for k, (n, w) in s.items() if k not in skip]
        return (best, live) if what else best

    class _Pause:
        def __init__(self, tracker):
            self.t = tracker

        def __enter__(self):
            self.t._paused += 1

        def __exit__(self, *exc):
            self.t._paused -= 1

    def paused(self):
        return StorageTrace._Pause(self)

    def emulate_gpu(self, monkeypatch, module):
        import gc

        from triton.runtime import interpreter

        launch = interpreter.GridExecutor.__call__

        def launch_and_collect(executor, *args, **kwargs):
            out = launch(executor, *args, **kwargs)
            gc.collect(1)  # the cycle is young; a full collection per launch would be slow
            return out

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch_and_collect)

        def mm_f32(a, b, out=None):
            if out is None:
                out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32)
            with self.paused():
                torch.mm(a.float(), b.float(), out=out)
            self.mm_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            return out

        def addmm_f32_(acc, a, b):
            with self.paused():
                acc.addmm_(a.float(), b.float())
            self.mm_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]

        monkeypatch.setattr(module, "mm_f32", mm_f32)
        monkeypatch.setattr(module, "addmm_f32_", addmm_f32_)


class OpLog:
    """Names of the aten ops run while active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        names = self.names = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
