"""Rank-0 logging with the ``[liger_fsdp]`` prefix the user greps for (one line per event), and the lines said once
per run (:func:`say_once`): a run starts with :func:`new_run`; a launcher hands what it said to the processes it
starts (:func:`handed_on`), which take it out of their environment when their run starts, so no other process and no
later run in the same process inherits it. A refusal in a rank of a multi-process launch is one line from rank 0
(:func:`one_message_per_run`); one that ends a single process is one line too (:func:`new_run` installs the hook).

Each line goes to the terminal (stderr, the plugin's own handler) and also to the handlers LLaMA-Factory's lines go
to in this process other than its terminal stream (:class:`_Alongside`): in LlamaBoard's web UI mode that is
``running_log.txt``, which the page shows while the run trains."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import textwrap
import weakref

logger = logging.getLogger("llamafactory_liger_fsdp")
#: The logger whose handlers LLaMA-Factory's own lines go to (``llamafactory.extras.logging``; v1's too).
THEIRS = "llamafactory"


def _bar_active() -> bool:
    """A tqdm progress bar (the Trainer's) is on the terminal line right now: it ends without a newline."""
    std = sys.modules.get("tqdm.std")
    bars = getattr(getattr(std, "tqdm", None), "_instances", None) or ()
    return any(not getattr(bar, "disable", False) for bar in list(bars))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (test capture, redirected logs), on a line of its own (after
    a newline when a progress bar holds the current line)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass

    def format(self, record):
        return ("\n" if _bar_active() else "") + super().format(record)


#: This run's records (for a handler LLaMA-Factory adds after they were said: LlamaBoard's is added once the
#: arguments are parsed, and empties running_log.txt), and the handlers that already have them.
_KEPT: list[logging.LogRecord] = []
_FED: weakref.WeakSet = weakref.WeakSet()


class _Alongside(logging.Handler):
    """Hands each record also to the handlers of LLaMA-Factory's logger (:data:`THEIRS`) that are not streams (a
    stream is the terminal, where :class:`_StderrHandler` already wrote the line): LlamaBoard's ``LoggerHandler``
    (``running_log.txt``), a user's log file. A handler seen for the first time gets this run's earlier lines
    first."""

    def emit(self, record):
        found = logging.root.manager.loggerDict.get(THEIRS)
        for handler in list(getattr(found, "handlers", ())):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                continue
            if handler not in _FED:
                _FED.add(handler)
                for earlier in _KEPT:
                    _feed(handler, earlier)
            _feed(handler, record)
        _KEPT.append(record)
        del _KEPT[:-500]


def _feed(handler: logging.Handler, record: logging.LogRecord) -> None:
    if record.levelno >= handler.level:
        handler.handle(record)


if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.addHandler(_Alongside())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def rank() -> int:
    for key in ("RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _info(message: str, stacklevel: int) -> None:
    if rank() == 0:  # the record names the plugin's module that said it (LLaMA-Factory's log format shows it)
        logger.info(message, stacklevel=stacklevel + 1)


def info_rank0(message: str) -> None:
    """Log ``message`` on rank 0, on a line of its own."""
    _info(message, 2)


#: What a launching process already said, for the ranks it starts (comma-separated keys); each rank's run takes it
#: out of its own environment (:func:`new_run`).
SAID_ENV = "LLAMAFACTORY_LIGER_FSDP_SAID"
_SAID: set[str] = set()  # said by this run in this process
_HANDED: set[str] = set()  # said by the launcher that started this process (its ranks are the same run)
_KEY = "liger_fsdp_said"  # a said-once record's key (a LogRecord attribute)


def new_run() -> None:
    """A run starts in this process: nothing said yet, except what the launcher that started it said (taken out of
    the environment, so no process this one starts inherits it). Ending this process on the plugin's error is one
    line (:func:`_install_hook`)."""
    _SAID.clear()
    _HANDED.clear()
    _HANDED.update(k for k in os.environ.pop(SAID_ENV, "").split(",") if k)
    _KEPT[:] = [r for r in _KEPT if getattr(r, _KEY, None) in _HANDED]  # the launcher's, in this same process
    _install_hook()


def say_once(key: str, line: str | None) -> None:
    """Log ``line`` on rank 0 once per run (``key`` names it; the launcher and its ranks are one run)."""
    if line and key not in _SAID and key not in _HANDED:
        _SAID.add(key)
        if rank() == 0:
            logger.info(line, stacklevel=2, extra={_KEY: key})


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


def _errors() -> tuple[type, ...]:
    from .config import LigerFsdpConfigError, LigerFsdpDataError

    return LigerFsdpConfigError, LigerFsdpDataError


def _in_a_rank() -> bool:
    return any(os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")) and \
        os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")


#: LlamaBoard's page drops every key whose value is false from the command it runs; the string "false" survives.
LLAMABOARD_FALSE = ('In LlamaBoard, write a false value as the string "false" in Extra arguments (e.g. '
                    '{"liger_fsdp_guard": "false"}): the page drops keys set to false.')


def error_text(exc: BaseException) -> str:
    """The plugin's error as it ends a process: ``[liger_fsdp] error: <message>`` on one line (the terminal's grep).
    In LlamaBoard's web UI mode, whose failure box shows stderr unwrapped, it is wrapped at 100 columns, and a fix
    that sets a ``liger_fsdp`` key to false says how to write that on the page."""
    from .args import env_enabled

    text = f"[liger_fsdp] error: {exc}"
    if not env_enabled("LLAMABOARD_ENABLED"):
        return text
    if re.search(r"`liger_fsdp\w*: false`", text):
        text += " " + LLAMABOARD_FALSE
    return textwrap.fill(text, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def _close_bars() -> None:
    """Close the progress bars still open, so the error is the last thing on stderr (not a bar redrawn at exit)."""
    std = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", None) or ()):
        with contextlib.suppress(Exception):
            bar.close()


def _one_line_hook(previous):
    def excepthook(exc_type, exc, tb):
        errors = _errors()
        if not isinstance(exc, errors) or (_in_a_rank() and not (excepthook.ranks and isinstance(exc, errors[0]))):
            return previous(exc_type, exc, tb)
        if rank() == 0:
            _close_bars()
            print(error_text(exc), file=sys.stderr, flush=True)
        return None

    excepthook.liger_fsdp = True
    excepthook.ranks = False  # set once a refusal in a rank went through one_message_per_run
    return excepthook


def _install_hook(ranks: bool = False) -> None:
    """The plugin's error (a refusal, a guard stop, a data error) that ends a single process is its one message on
    stderr, not a traceback (exit status 1): LlamaBoard's failure box shows that stderr. In a rank of a multi-process
    launch, refusals are, once one went through :func:`one_message_per_run` (``ranks``); other errors stay as the
    launcher reports them."""
    if not getattr(sys.excepthook, "liger_fsdp", False):
        sys.excepthook = _one_line_hook(sys.excepthook)
    if ranks:
        sys.excepthook.ranks = True


@contextlib.contextmanager
def one_message_per_run():
    """Inside a rank of a multi-process launch, a refusal raised here ends the process as one line from rank 0 (the
    other ranks exit 1 silently) instead of a traceback per rank; in one process it is raised as it is (and ends the
    process as one line, :func:`_install_hook`)."""
    from .config import LigerFsdpConfigError

    try:
        yield
    except LigerFsdpConfigError:
        if _in_a_rank():
            _install_hook(ranks=True)
        raise


def one_line_hook(previous):
    """The plugin's one-line ``sys.excepthook`` around ``previous``, for a hook that wraps it (the ranks' hand-over of
    :mod:`.integration.stop`)."""
    return _one_line_hook(previous)
