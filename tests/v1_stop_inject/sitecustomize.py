"""TEST-ONLY (tests/test_refusal_launches.py): a 1% error in the plugin's per-token log-probs (v1's compute_log_probs
seam), in every process of the run, for the first-step guard to stop; then hands over to the next ``sitecustomize``."""

import os

from llamafactory_liger_fsdp import forward
from llamafactory_liger_fsdp._handover import next_sitecustomize

_honest = forward.token_logps


def _wrong(*args, **kwargs):
    logps, sums, vocab = _honest(*args, **kwargs)
    return logps * 1.01, sums, vocab


forward.token_logps = _wrong

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
