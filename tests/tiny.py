"""Transition shim: the tiny models moved to ``llamafactory_liger_fsdp.testing`` (removed once every test imports it)."""

from llamafactory_liger_fsdp.testing import *  # noqa: F401,F403
from llamafactory_liger_fsdp.testing import rel  # noqa: F401
