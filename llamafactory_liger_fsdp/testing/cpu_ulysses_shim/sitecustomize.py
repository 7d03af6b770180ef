"""TEST-ONLY: put on ``PYTHONPATH`` (before any other shim directory) so every process of a v1 run with
``cp_size > 1`` on CPU ranks gets :mod:`llamafactory_liger_fsdp.testing.cpu_ulysses`'s stand-ins; then hands over
to the next ``sitecustomize`` on the path (another shim's), if there is one."""

import os
import sys

from llamafactory_liger_fsdp.testing import cpu_ulysses

cpu_ulysses.install()

_here = os.path.dirname(os.path.abspath(__file__))
_path = sys.path[:]
_self = sys.modules.pop("sitecustomize", None)
sys.path[:] = [p for p in _path if os.path.abspath(p or os.curdir) != _here]
try:
    import sitecustomize  # noqa: F401  (the next shim's, if any)
except ImportError:
    if _self is not None:
        sys.modules["sitecustomize"] = _self
finally:
    sys.path[:] = _path
