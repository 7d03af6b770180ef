"""TEST-ONLY shim: let LLaMA-Factory's v1 engine train on CPU ranks with a CUDA build of torch.

v1's ``DistributedInterface().sync()`` calls ``torch.accelerator.synchronize()`` after every step; on a CUDA build of
torch without a GPU that initialises CUDA and fails (``Found no NVIDIA driver on your system``), although v1 itself
picked the CPU (``torch.accelerator.current_accelerator()`` is None there). Tests put this directory on PYTHONPATH so
every process of a ``USE_V1=1 llamafactory-cli`` run (the torchrun workers included) skips that call when no
accelerator is available. Nothing else changes: v1 still picks gloo and the CPU by itself.

Test support only: tests/ (tests/support/v1.py) and bench/v1.py's CPU runs put this directory on PYTHONPATH;
the package never imports it.
"""

import torch

_original = torch.accelerator.synchronize


def _synchronize(device=None):
    if torch.accelerator.is_available():
        return _original(device)
    return None


torch.accelerator.synchronize = _synchronize

