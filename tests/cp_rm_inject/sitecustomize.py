"""TEST-ONLY (tests/test_v1_cp_pref.py): a 1% error in the plugin's v1 RM loss under sequence parallelism, in every
process of the run, for the guard to stop; then hands over to the next ``sitecustomize`` on the path."""

import os
import sys

from llamafactory_liger_fsdp._handover import next_sitecustomize
from llamafactory_liger_fsdp.integration.v1 import cp_rm

_honest = cp_rm.cp_loss


def _wrong(*args, **kwargs):
    if not _wrong.said:
        _wrong.said = True
        print("[cp_rm_inject] the plugin's CP RM loss x 1.01", file=sys.stderr, flush=True)
    return _honest(*args, **kwargs) * 1.01


_wrong.said = False
cp_rm.cp_loss = _wrong

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
