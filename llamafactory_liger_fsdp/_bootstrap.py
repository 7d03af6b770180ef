"""Import-time registration of the plugin.

``llamafactory_liger_fsdp.pth`` (installed at the top of site-packages by ``pip install .`` and
``pip install -e .``) imports this module in *every* Python process of the environment: the
``llamafactory-cli`` parent, the torchrun workers it starts with ``FORCE_TORCHRUN=1`` and
``accelerate launch`` workers. So this module must stay cheap and must never break start-up:
it imports nothing but :mod:`.hooked` (names) and :mod:`._import_hook`, and only puts a finder on ``sys.meta_path``: ``python -c pass``
costs about what it costs without the plugin (``bench/results/archive/hook_cost.json``; ``tests/test_bootstrap.py`` checks what it
imports). The ``.pth`` line itself is silent where the package is gone but the line is not (pip part-way through
reinstalling the plugin runs Python with the old line in place); any other import error is reported as site does.

The finder waits for the LLaMA-Factory modules that the plugin hooks (:mod:`.hooked`), and right after
each one has executed (and *before* any ``from .loader import load_model`` elsewhere binds the
name) hands it to :func:`llamafactory_liger_fsdp.integration.on_module_loaded`, which patches it.
Nothing is patched in a process that never imports LLaMA-Factory.

``LLAMAFACTORY_LIGER_FSDP_PTH=0`` makes the ``.pth`` line do nothing: then only
``python -m llamafactory_liger_fsdp train`` activates the plugin (for its launcher and every worker, through
``_activate/sitecustomize.py`` on ``PYTHONPATH``) -- the same path as an install the ``.pth`` never reaches
(``pip install --target``, a package on ``PYTHONPATH``).

With ``LLAMAFACTORY_LIGER_FSDP_DISABLE=1`` the hook stays (so yamls that name ``liger_fsdp`` still
parse) but the plugin is off: the keys are accepted and ignored, one log line says so.
"""

import os
import sys

from ._import_hook import after_import
from .hooked import MODULES as HOOKED_MODULES

#: True once the finder is on ``sys.meta_path`` in this process (read by ``doctor``).
ACTIVE = False


_UNAVAILABLE: list = []  # said once a process


def _loaded(module) -> None:
    """Hand a hooked module to the integration; nothing raised here reaches the import of ``module``."""
    try:
        from llamafactory_liger_fsdp import integration

        integration.on_module_loaded(module.__name__, module)
    except Exception as exc:  # the integration itself cannot be imported (a broken install)
        if _UNAVAILABLE:
            return
        _UNAVAILABLE.append(module.__name__)
        print(f"[liger_fsdp] unavailable: cannot hook {module.__name__} ({type(exc).__name__}: {exc}); it runs as "
              "installed, without the plugin. Fix: reinstall the plugin (`pip install .`), and report this line.",
              file=sys.stderr, flush=True)


def install() -> bool:
    """Put the finder on ``sys.meta_path`` (once a process); hooked modules already imported before it (rare: an
    interactive session that imported the plugin late) are patched now. Returns whether the hook is active."""
    global ACTIVE
    after_import("llamafactory_liger_fsdp", HOOKED_MODULES, _loaded)
    ACTIVE = True
    return True


PTH_ENV = "LLAMAFACTORY_LIGER_FSDP_PTH"

if os.environ.get(PTH_ENV, "1").strip() != "0":
    try:
        install()
    except Exception as exc:  # never break interpreter start-up
        print(f"[liger_fsdp] import hook not installed: {exc!r}", file=sys.stderr)
