"""Put on ``PYTHONPATH`` by ``python -m llamafactory_liger_fsdp train``: activates the plugin in every Python
process of the run (the launcher's torchrun workers included), then hands over to the next
``sitecustomize`` on the path, if there is one."""

import os
import sys

import llamafactory_liger_fsdp._bootstrap as _bootstrap

_bootstrap.install()

_here = os.path.dirname(os.path.abspath(__file__))
_path = sys.path[:]
sys.modules.pop("sitecustomize", None)
sys.path[:] = [p for p in _path if os.path.abspath(p or os.curdir) != _here]
try:
    import sitecustomize  # noqa: F401  (the environment's own, if any)
except ImportError:
    pass
finally:
    sys.path[:] = _path
