"""Run a function on a module right after it has executed on import: a ``sys.meta_path`` finder that answers only
for a fixed set of module names and wraps their real loader. One home for the plugin's hook (:mod:`._bootstrap`) and
the test-only CPU stand-ins (:mod:`.testing`). Imports nothing but ``sys``: it runs at every interpreter start."""

import sys


class _Loader:
    """Delegates to the real loader, then calls ``then(module)``. (A plain class: ``importlib.abc`` would import
    ``importlib.resources``, ``pathlib``, ``tempfile`` and ``re`` into every Python process.)"""

    def __init__(self, inner, then):
        self._inner, self._then = inner, then

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._then(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ...
        return getattr(self._inner, name)


class AfterImport:
    """The finder: the spec the other finders give for a name in ``names``, its loader wrapped."""

    def __init__(self, key: str, names, then):
        self.key, self.names, self.then = key, frozenset(names), then

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.then)
                return spec
        return None


def installed(key: str) -> bool:
    """Whether a finder of this ``key`` is on ``sys.meta_path``."""
    return any(isinstance(f, AfterImport) and f.key == key for f in sys.meta_path)


def after_import(key: str, names, then) -> bool:
    """Call ``then(module)`` on each module of ``names`` right after it executes; those already imported now. Once
    per ``key`` and process: returns False (and does nothing) when that finder is there already."""
    if installed(key):
        return False
    finder = AfterImport(key, names, then)
    sys.meta_path.insert(0, finder)
    for name in sorted(finder.names):
        if name in sys.modules:
            then(sys.modules[name])
    return True
