"""The plugin's stop is the last thing the user reads, under every launcher: a refusal or a guard stop raised in the
ranks is handed to the launching process, which prints it after its ranks ended -- after torchrun's own failure
summary, instead of a ChildFailedError / "Root Cause" block or a CalledProcessError traceback.

* The outermost plugin-aware launching process (``llamafactory-cli``'s launcher, ``accelerate launch``, a bare
  ``torchrun``: :func:`.launch.patch_torchrun`) makes a directory for the launch and names it to its ranks in
  :data:`ENV` (:func:`collecting`); a launcher nested inside another (torchrun started by ``llamafactory-cli``)
  leaves the printing to the outer one.
* A rank whose launcher collects ends on the plugin's error (:class:`.config.LigerFsdpConfigError` -- a refusal, a
  guard stop -- or :class:`.config.LigerFsdpDataError`) by writing its message there and printing nothing
  (:func:`install_in_rank`; other exceptions keep their traceback).
* When the launch fails, the launching process prints the messages its ranks left, in rank order, each once, and
  exits 1 (:func:`say_last`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Any

from .. import _log

ENV = "LLAMAFACTORY_LIGER_FSDP_STOP_DIR"
MOST = 8  # distinct messages printed (a guard stop differs per rank only by its numbers)


def _errors() -> tuple[type, ...]:
    from ..config import LigerFsdpConfigError, LigerFsdpDataError

    return LigerFsdpConfigError, LigerFsdpDataError


def _text(message: str) -> str:
    """``[liger_fsdp] error: <message>`` as the process that ends on it prints it (:func:`.._log.error_text`)."""
    return _log.error_text(message)


# --------------------------------------------------------------------------- the launching process
@contextlib.contextmanager
def collecting():
    """Inside, the ranks this process starts hand their stop over (yields the directory), unless an outer launching
    process collects already (yields None). The environment is as before afterwards."""
    if os.environ.get(ENV):
        yield None
        return
    where = tempfile.mkdtemp(prefix="liger_fsdp_stop_")
    os.environ[ENV] = where
    try:
        yield where
    finally:
        os.environ.pop(ENV, None)
        shutil.rmtree(where, ignore_errors=True)


def messages(where: str | None) -> list[str]:
    """The messages the ranks left, in rank order, each once."""
    if not where or not os.path.isdir(where):
        return []
    found: list[str] = []
    for name in sorted(os.listdir(where)):
        with contextlib.suppress(OSError), open(os.path.join(where, name), encoding="utf-8") as f:
            text = f.read().strip()
        if text and text not in found:
            found.append(text)
    return found


def failed(exc: BaseException) -> bool:
    return isinstance(exc, Exception) or (isinstance(exc, SystemExit) and exc.code not in (0, None))


def say_last(where: str | None, exc: BaseException) -> None:
    """After a failed launch: the ranks' messages, printed last, and exit 1; nothing where none was left."""
    found = messages(where)
    if not found or not failed(exc):
        return
    for text in found[:MOST]:
        print(_text(text), file=sys.stderr, flush=True)
    if len(found) > MOST:
        print(f"[liger_fsdp] ({len(found) - MOST} more ranks stopped with the same error, their own numbers)",
              file=sys.stderr, flush=True)
    sys.exit(1)


def run_collecting(original, *args: Any):
    """``original(*args)`` (a launcher's own function) with its ranks' stops printed last: by this process where it
    is the outermost that collects, else left to the outer one (this one then exits 1 quietly)."""
    with collecting() as where:
        try:
            return original(*args)
        except BaseException as exc:
            if where is not None:
                say_last(where, exc)
            elif failed(exc) and messages(os.environ.get(ENV)):
                sys.exit(1)  # the outer launcher prints them after this one's summary
            raise


# --------------------------------------------------------------------------- a rank
class _RankHook:
    """``sys.excepthook`` of a rank whose launcher collects: the plugin's error is handed over and not printed;
    anything else goes to the hook it replaced (the plugin's one-line hook of :mod:`.._log` around the previous)."""

    liger_fsdp = True  # the plugin's hook: :mod:`.._log` does not put another around it

    def __init__(self, previous):
        self.inner = previous if getattr(previous, "liger_fsdp", False) else _log.one_line_hook(previous)

    @property
    def ranks(self) -> bool:
        return bool(getattr(self.inner, "ranks", False))

    @ranks.setter
    def ranks(self, value: bool) -> None:
        with contextlib.suppress(AttributeError):
            self.inner.ranks = value

    def __call__(self, exc_type, exc, tb):
        if isinstance(exc, _errors()) and hand_over(exc):
            return None
        return self.inner(exc_type, exc, tb)


def _rank_id() -> str | None:
    for key in ("RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return os.environ[key]
    return None


def hand_over(exc: BaseException) -> bool:
    """Write this rank's message for its launcher; False where no launcher collects."""
    where, rank = os.environ.get(ENV), _rank_id()
    if not where or rank is None or not os.path.isdir(where):
        return False
    try:
        with open(os.path.join(where, f"rank{int(rank):06d}"), "w", encoding="utf-8") as f:
            f.write(str(exc))
    except OSError:
        return False
    return True


def install_in_rank() -> None:
    """In a rank whose launcher collects (:data:`ENV` set, ``RANK``/``LOCAL_RANK`` set): the plugin's error ends it
    quietly, handed over. Once a process."""
    if os.environ.get(ENV) and _rank_id() is not None and not isinstance(sys.excepthook, _RankHook):
        sys.excepthook = _RankHook(sys.excepthook)
