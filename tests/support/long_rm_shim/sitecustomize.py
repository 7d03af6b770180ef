"""TEST-ONLY: the long-context limit of the plugin's RM guard scaled to CPU rows. Where
``llamafactory_liger_fsdp.integration.v1.cp_rm`` has an ``UNSPLIT_TOKENS`` (a micro-batch above it "too long to
check unsplit"), it becomes ``$LONG_RM_TOKENS``, so that at data parallel x CP one data-parallel group's micro-batch
is over it and the other's is not, as 65,536 tokens divides them on a cluster; a plugin without the limit is left as
it is. Then hands over to the next ``sitecustomize`` on the path."""

import os

from llamafactory_liger_fsdp import _import_hook
from llamafactory_liger_fsdp._handover import next_sitecustomize

MODULE = "llamafactory_liger_fsdp.integration.v1.cp_rm"


def _scale(module) -> None:
    if hasattr(module, "UNSPLIT_TOKENS"):
        module.UNSPLIT_TOKENS = int(os.environ["LONG_RM_TOKENS"])


if os.environ.get("LONG_RM_TOKENS"):
    _import_hook.after_import("long_rm", [MODULE], _scale)

next_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
