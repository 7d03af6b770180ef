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


def info_rank0(message: str) -> None:
    if rank() == 0:
        logger.info(message)
