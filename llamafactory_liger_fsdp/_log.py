"""Rank-0 logging with the ``[liger_fsdp]`` prefix the user greps for (one line per event), and the lines said once
per run (:func:`say_once`): a run starts with :func:`new_run`; a launcher hands what it said to the processes it
starts (:func:`handed_on`), which take it out of their environment when their run starts, so no other process and no
later run in the same process inherits it. A refusal in a rank of a multi-process launch is one line from rank 0
(:func:`one_message_per_run`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

logger = logging.getLogger("llamafactory_liger_fsdp")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (test capture, redirected logs)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def rank() -> int:
    for key in ("RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _bar_active() -> bool:
    """A tqdm progress bar (the Trainer's) is on the terminal line right now: it ends without a newline."""
    std = sys.modules.get("tqdm.std")
    bars = getattr(getattr(std, "tqdm", None), "_instances", None) or ()
    return any(not getattr(bar, "disable", False) for bar in list(bars))


def info_rank0(message: str) -> None:
    """Log ``message`` on rank 0, on a line of its own (after a newline when a progress bar holds the current line)."""
    if rank() == 0:
        logger.info(("\n" if _bar_active() else "") + message)


#: What a launching process already said, for the ranks it starts (comma-separated keys); each rank's run takes it
#: out of its own environment (:func:`new_run`).
SAID_ENV = "LLAMAFACTORY_LIGER_FSDP_SAID"
_SAID: set[str] = set()  # said by this run in this process
_HANDED: set[str] = set()  # said by the launcher that started this process (its ranks are the same run)


def new_run() -> None:
    """A run starts in this process: nothing said yet, except what the launcher that started it said (taken out of
    the environment, so no process this one starts inherits it)."""
    _SAID.clear()
    _HANDED.clear()
    _HANDED.update(k for k in os.environ.pop(SAID_ENV, "").split(",") if k)


def say_once(key: str, line: str | None) -> None:
    """Log ``line`` on rank 0 once per run (``key`` names it; the launcher and its ranks are one run)."""
    if line and key not in _SAID and key not in _HANDED:
        _SAID.add(key)
        info_rank0(line)


@contextlib.contextmanager
def handed_on():
    """Inside, the processes a launcher starts see what it said (:data:`SAID_ENV`); afterwards the launcher's own
    environment is as it was, and a later run in this process says its lines again."""
    saved = os.environ.get(SAID_ENV)
    if _SAID:
        os.environ[SAID_ENV] = ",".join(sorted(_SAID | _HANDED))
    try:
        yield
    finally:
        _HANDED.clear()
        if saved is None:
            os.environ.pop(SAID_ENV, None)
        else:
            os.environ[SAID_ENV] = saved


def _config_error() -> type:
    from .config import LigerFsdpConfigError

    return LigerFsdpConfigError


def _in_a_rank() -> bool:
    return any(os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")) and \
        os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")


def _one_line_hook(previous):
    def excepthook(exc_type, exc, tb):
        if not isinstance(exc, _config_error()):
            return previous(exc_type, exc, tb)
        if rank() == 0:
            print(f"[liger_fsdp] error: {exc}", file=sys.stderr, flush=True)
        return None

    excepthook.liger_fsdp = True
    return excepthook


@contextlib.contextmanager
def one_message_per_run():
    """Inside a rank of a multi-process launch, a refusal raised here ends the process as one line from rank 0 (the
    other ranks exit 1 silently) instead of a traceback per rank; in one process it is raised as it is."""
    try:
        yield
    except _config_error():
        if _in_a_rank() and not getattr(sys.excepthook, "liger_fsdp", False):
            sys.excepthook = _one_line_hook(sys.excepthook)
        raise
