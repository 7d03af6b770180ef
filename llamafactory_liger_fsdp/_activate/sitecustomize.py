"""Put on ``PYTHONPATH`` by ``python -m llamafactory_liger_fsdp train``: activates the plugin in every Python
process of the run (the launcher's torchrun workers included), then hands over to the next
``sitecustomize`` on the path, if there is one. When there is none, this module stays registered as
``sitecustomize`` (the import system looks its name up after running it: removing it printed
``Error in sitecustomize ... KeyError: 'sitecustomize'`` in every worker)."""

import os

import llamafactory_liger_fsdp._bootstrap as _bootstrap
from llamafactory_liger_fsdp._handover import next_sitecustomize

_bootstrap.install()

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
