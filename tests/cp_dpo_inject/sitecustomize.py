"""TEST-ONLY (tests/test_v1_cp_pref.py): a 1% error in the per-token log-probs of the plugin's v1 DPO under sequence
parallelism, in every process of the run, for the guard to stop; then hands over to the next ``sitecustomize``."""

import os
import sys

from llamafactory_liger_fsdp._handover import next_sitecustomize
from llamafactory_liger_fsdp.integration.v1 import cp_dpo

_honest = cp_dpo.cp_logps


def _wrong(sp):
    honest = _honest(sp)

    def logps_of(*args, **kwargs):
        if not _wrong.said:
            _wrong.said = True
            print("[cp_dpo_inject] the plugin's CP DPO log-probs x 1.01", file=sys.stderr, flush=True)
        logps, sums, vocab = honest(*args, **kwargs)
        return logps * 1.01, sums, vocab

    return logps_of


_wrong.said = False
cp_dpo.cp_logps = _wrong

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
