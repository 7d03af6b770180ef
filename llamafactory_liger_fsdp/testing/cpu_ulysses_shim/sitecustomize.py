"""TEST-ONLY: put on ``PYTHONPATH`` (before any other shim directory) so every process of a v1 run with
``cp_size > 1`` on CPU ranks gets :mod:`llamafactory_liger_fsdp.testing.cpu_ulysses`'s stand-ins; then hands over
to the next ``sitecustomize`` on the path (another shim's), if there is one."""

import os

from llamafactory_liger_fsdp._handover import next_sitecustomize
from llamafactory_liger_fsdp.testing import cpu_ulysses

cpu_ulysses.install()

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
