"""Put on ``PYTHONPATH`` by ``python -m llamafactory_liger_fsdp train``: activates the plugin in every Python
process of the run (the launcher's torchrun workers included), then hands over to the next
``sitecustomize`` on the path, if there is one. When there is none, this module stays registered as
``sitecustomize`` (the import system looks its name up after running it: removing it printed
``Error in sitecustomize ... KeyError: 'sitecustomize'`` in every worker)."""

import os
import sys

import llamafactory_liger_fsdp._bootstrap as _bootstrap

_bootstrap.install()

_here = os.path.dirname(os.path.abspath(__file__))
_path = sys.path[:]
_self = sys.modules.pop("sitecustomize", None)
sys.path[:] = [p for p in _path if os.path.abspath(p or os.curdir) != _here]
try:
    import sitecustomize  # noqa: F401  (the environment's own, if any)
except ImportError:
    if _self is not None:
        sys.modules["sitecustomize"] = _self
finally:
    sys.path[:] = _path
