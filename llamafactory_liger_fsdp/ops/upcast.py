"""The CPU's fp32 operand copies, named for the profiler.

A CPU has no 16-bit x 16-bit -> fp32 GEMM, so the kernels and the guard's fp32 head copy their 16-bit operands to fp32
there; a GPU multiplies the 16-bit operands as they are. Those copies run inside :data:`SCOPE` (a
``torch.profiler.record_function`` scope), so a CPU run that stands in for a GPU run's memory (testing/memory_twin.py)
can leave them out.
"""

from __future__ import annotations

import torch

SCOPE = "## cpu-only fp32 operands"


def to_fp32(*tensors: torch.Tensor) -> list:
    """The tensors in fp32, copied inside :data:`SCOPE` (the caller frees them with the GEMM that reads them)."""
    with torch.profiler.record_function(SCOPE):
        return [t.float() for t in tensors]
