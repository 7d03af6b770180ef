"""TEST-ONLY (tests/test_v1_cp.py): a 1% error in the plugin's v1 sequence-parallel loss, in every process of the run,
for the guard to stop; then hands over to the next ``sitecustomize`` on the path."""

import os
import sys

from llamafactory_liger_fsdp.integration.v1 import cp as v1_cp

_honest = v1_cp.fused_sequence_parallel_loss


def _wrong(*args, **kwargs):
    if not _wrong.said:
        _wrong.said = True
        print("[cp_inject] the plugin's CP loss x 1.01", file=sys.stderr, flush=True)
    return _honest(*args, **kwargs) * 1.01


_wrong.said = False
v1_cp.fused_sequence_parallel_loss = _wrong

_here = os.path.dirname(os.path.abspath(__file__))
_path = sys.path[:]
_self = sys.modules.pop("sitecustomize", None)
sys.path[:] = [p for p in _path if os.path.abspath(p or os.curdir) != _here]
try:
    import sitecustomize  # noqa: F401  (the next shim's)
except ImportError:
    if _self is not None:
        sys.modules["sitecustomize"] = _self
finally:
    sys.path[:] = _path
