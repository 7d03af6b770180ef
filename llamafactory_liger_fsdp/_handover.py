"""A ``sitecustomize`` of ours that has done its work hands over to the next one on ``sys.path`` (the environment's
own, or another shim's), if there is one. Imports nothing but ``os`` and ``sys``: it runs at every interpreter start
of a run that puts such a directory on ``PYTHONPATH``."""

import os
import sys


def next_sitecustomize(here: str) -> None:
    """Import the next ``sitecustomize`` after the directory ``here``. When there is none, ours stays registered
    (the import system looks its name up after running it: removing it printed ``Error in sitecustomize ...
    KeyError: 'sitecustomize'`` in every worker)."""
    path = sys.path[:]
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = path
