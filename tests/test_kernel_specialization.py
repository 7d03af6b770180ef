"""A new number of labelled rows compiles no Triton kernel again (issue 50: a compile in step 2 or 3 stalled the step).

Triton compiles a kernel once per *specialization* of its arguments: an int's divisibility by 16 (and == 1), a
pointer's 16-byte alignment. The number of labelled rows changes every step, and so do the offsets of row slices; the
kernels must not specialize on them. Checked on the CPU: every launch of the real loss (fast, lean, per-row and fused
paths, 47 and 48 labelled rows, a chunk boundary that leaves an odd slice) is recorded under the interpreter, and each
launch's specialization is computed by Triton's own binder for an sm_90 target, as the GPU launcher would; the two row
counts must give the same specializations. A control shows the check sees a kernel that does specialize.
"""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy, triton_common, triton_fused
from llamafactory_liger_fsdp.ops import triton_kernels as tk

KERNELS = {"stats": tk.stats_kernel, "dz": tk._dz_kernel, "dz_inplace": tk._dz_inplace_kernel,
           "rows_axpy": tk._rows_axpy_kernel, "scale_cast": tk._scale_cast_kernel, "fused": triton_fused._fused_kernel}
BACKEND = make_backend(GPUTarget("cuda", 90, 128))


def as_jit(kernel) -> JITFunction:
    """The compiled-path JITFunction of ``kernel`` (under the interpreter it is an InterpretedFunction with the same
    function and decorator options)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


def specialization(kernel, args, kwargs):
    """What Triton's launcher keys its compile cache on for these launch arguments (sm_90)."""
    jit = as_jit(kernel)
    binder = create_function_from_signature(jit.signature, jit.params, BACKEND)
    return repr(binder(*args, **kwargs)[1])


@pytest.fixture
def record(monkeypatch):
    """Each kernel's launches: name -> [(args, kwargs)], recorded and then run."""
    seen = {name: [] for name in KERNELS}
    for name, kernel in KERNELS.items():
        real = kernel.run

        def run(*args, grid, warmup, _name=name, _real=real, **kwargs):
            seen[_name].append((args, kwargs))
            return _real(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return seen


def launches(seen, n_valid, backend, reduction, fused):
    """Run the loss forward + backward with ``n_valid`` labelled rows of 64; the specializations of its launches."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 32, generator=g) * 0.2).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 48, (64,), generator=g)
    y[n_valid:] = -100
    for rows in seen.values():
        rows.clear()
    loss = fused_linear_cross_entropy(h, w, y, backend=backend, reduction=reduction)
    loss.backward(torch.ones_like(loss) if reduction == "none" else None)
    return {name: {specialization(KERNELS[name], a, k) for a, k in rows} for name, rows in seen.items()}


@pytest.mark.parametrize("backend,reduction,fused", [("triton_fast", "mean", False), ("triton", "mean", False),
                                                     ("triton", "none", False), ("triton", "mean", True),
                                                     ("triton_fast", "sum", True)])
def test_a_new_row_count_compiles_nothing_new(monkeypatch, record, backend, reduction, fused):
    monkeypatch.setattr(triton_common, "FAST_CHUNK_ROWS", 16)  # several chunks: the last one an odd slice of rows
    if fused:
        monkeypatch.setattr(triton_fused, "FORCE", True)
        monkeypatch.setattr(triton_fused, "CONFIG", (32, 64, 32, 1, 1, 2, False))
        monkeypatch.setattr(triton_fused, "RULES", [(1 << 30, "recompute" if backend == "triton_fast" else None, True)])
    a = launches(record, 48, backend, reduction, fused)
    b = launches(record, 47, backend, reduction, fused)
    assert any(a.values()), "no kernel launched"
    if fused:
        assert a["fused"], "the fused GEMM did not run"
    for name in KERNELS:
        assert a[name] == b[name], f"{name}: 47 labelled rows specialize differently from 48"


def test_the_check_sees_a_kernel_that_specializes(record):
    """Control: the same dz kernel without ``do_not_specialize`` gives 47 and 48 rows different specializations."""
    launches(record, 48, "triton_fast", "mean", False)
    (args, kwargs), = record["dz_inplace"][:1]
    plain = triton.jit(as_jit(tk._dz_inplace_kernel).fn)
    rows = list(args)
    i = as_jit(tk._dz_inplace_kernel).arg_names.index("n_rows")
    rows[i] = 48
    a = specialization(plain, rows, kwargs)
    rows[i] = 47
    assert specialization(plain, rows, kwargs) != a
    assert specialization(tk._dz_inplace_kernel, rows, kwargs) == specialization(tk._dz_inplace_kernel,
                                                                                  rows[:i] + [48] + rows[i + 1:], kwargs)
