"""Rank-0 logging with the ``[liger_fsdp]`` prefix the user greps for (one line per event)."""

from __future__ import annotations

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
