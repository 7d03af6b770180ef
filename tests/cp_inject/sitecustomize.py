"""TEST-ONLY (tests/test_v1_cp.py): a 1% error in the plugin's v1 sequence-parallel loss, in every process of the run,
for the guard to stop; then hands over to the next ``sitecustomize`` on the path."""

import os
import sys

from llamafactory_liger_fsdp._handover import next_sitecustomize
from llamafactory_liger_fsdp.integration.v1 import cp as v1_cp

_honest = v1_cp.fused_sequence_parallel_loss


def _wrong(*args, **kwargs):
    if not _wrong.said:
        _wrong.said = True
        print("[cp_inject] the plugin's CP loss x 1.01", file=sys.stderr, flush=True)
    return _honest(*args, **kwargs) * 1.01


_wrong.said = False
v1_cp.fused_sequence_parallel_loss = _wrong

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
