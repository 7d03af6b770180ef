"""Tested means this code: the upstream functions the plugin depends on are judged by their code, not by their
version string (llamafactory_liger_fsdp/fingerprints.py), and v1 DPO's / RM's ``__init__`` under CP run as written
without their cp_size refusal (integration/v1/cp_init.py)."""

from __future__ import annotations

import ast
import inspect
import logging
import sys
import textwrap
import types
from types import SimpleNamespace

import pytest

from llamafactory_liger_fsdp import _patch, fingerprints, versions
from llamafactory_liger_fsdp.config import LigerFsdpConfigError

SP = "llamafactory.v1.plugins.model_plugins.parallelization.sequence_parallel"
RM_INIT = "llamafactory.v1.trainers.rm_trainer:RMTrainer.__init__"
SP_LOSS = f"{SP}:sequence_parallel_loss"


@pytest.fixture(autouse=True)
def fresh_run(monkeypatch):
    """Each test its own set of used pieces and said lines; the patches it made (``why`` "test") undone -- not those
    the import hook made while a test imported LLaMA-Factory's modules."""
    from llamafactory_liger_fsdp import _log

    monkeypatch.setattr(fingerprints, "_USED", {})
    monkeypatch.setattr(_log, "_SAID", set())
    yield
    for patch in [p for p in _patch._APPLIED if p.why == "test"][::-1]:
        _patch.undo(patch.owner, patch.name)


def edited_copy(fn, old: str, new: str, tmp_path, owner: type | None = None):
    """``fn`` with ``old`` replaced by ``new`` in its body, compiled from a copy of its module's file (same module,
    same qualified name, the installed version string unchanged: only the code differs)."""
    fn = inspect.unwrap(fn)
    path = inspect.getsourcefile(fn)
    lines, first = inspect.getsourcelines(fn)
    source = "".join(lines)
    assert old in source, f"{old!r} not in {fn.__qualname__}"
    target = tmp_path / f"edited_{fn.__name__}.py"
    target.write_text(open(path, encoding="utf-8").read().replace(source, source.replace(old, new, 1), 1))
    edited = inspect.getsourcelines(fn)[0]  # same start line in the copy
    body = open(target, encoding="utf-8").read().splitlines(keepends=True)[first - 1:]
    body = body[:len(edited) + new.count("\n") - old.count("\n")]
    indent = "" if not body[0].startswith(" ") else None
    text = "".join(body) if indent == "" else "class _C:\n" + "".join(body)
    tree = ast.parse(text)
    ast.increment_lineno(tree, first - (1 if indent == "" else 2))
    module = compile(tree, str(target), "exec", dont_inherit=True)
    codes = [c for c in module.co_consts if isinstance(c, types.CodeType)]
    if indent is None:
        codes = [c for c in codes[0].co_consts if isinstance(c, types.CodeType)]
    code = next(c for c in codes if c.co_name == fn.__name__)
    closure = (types.CellType(owner),) if code.co_freevars else None
    out = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    out.__qualname__, out.__module__ = fn.__qualname__, fn.__module__
    assert fingerprints.fingerprint(out) != fingerprints.fingerprint(fn)
    return out


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "untested code" in r.getMessage()]


# --------------------------------------------------------------------------- the fingerprint
def test_fingerprint_is_the_code_not_its_formatting(tmp_path):
    variants = {
        "a": 'def f(x, y=1):\n    """Doc."""\n    z = x + y  # sum\n    return z * 2\n',
        "b": "def f(x, y = 1):\n    z = (x +\n         y)\n\n    return z*2\n",  # no docstring or comment, other layout
        "c": 'def f(x, y=1):\n    """Doc."""\n    z = x + y\n    return z * 3\n',  # one constant changed
        "d": 'def f(x, y=1):\n    """Doc."""\n    z = x - y\n    return z * 2\n',  # one operator changed
    }
    prints = {}
    for key, text in variants.items():
        path = tmp_path / f"m_{key}.py"
        path.write_text(text)
        scope: dict = {}
        exec(compile(text, str(path), "exec"), scope)
        prints[key] = fingerprints.fingerprint(scope["f"])
    assert prints["a"] == prints["b"]
    assert len({prints["a"], prints["c"], prints["d"]}) == 3


def test_static_pieces_are_named_where_they_are_defined():
    """A patched original is recognised by where it is defined: each registered name must be that place."""
    found = 0
    for piece in fingerprints.PIECES:
        try:
            fn = fingerprints.resolve(piece.name)
        except (ImportError, AttributeError):
            continue  # not on this stack (v1's DPOTrainer before git main)
        found += 1
        assert fingerprints.definition(fn) == piece.name
    assert found >= len(fingerprints.PIECES) - 4


def test_this_stack_is_recorded():
    """Every piece this stack has was seen by CI (run on each stack by scripts/test_stacks.sh)."""
    gone = fingerprints.missing()
    assert not gone, ("code CI never saw on this stack (" + fingerprints.stack_label() + "): " + ", ".join(gone) +
                      ". Re-record on each CI stack: python -m llamafactory_liger_fsdp fingerprints --record LABEL")


# --------------------------------------------------------------------------- changed code, same version string
def test_v1_trainer_method_changed_under_the_same_version_is_untested_and_stops(tmp_path, monkeypatch, caplog):
    from llamafactory.v1.trainers.rm_trainer import RMTrainer

    from llamafactory_liger_fsdp.integration.v1 import cp_init

    version = versions.installed("llamafactory")
    assert not versions.untested({"llamafactory": version})  # the version string alone: tested
    undo = cp_init.patch(RMTrainer, lambda m: True, lambda t, m: None, "test")
    assert fingerprints.unseen() == [] and RM_INIT in fingerprints._USED  # as CI saw it: tested
    for step in undo:
        step()

    edited = edited_copy(RMTrainer.__init__, "super().__init__(", "self.extra = 0\n        super().__init__(",
                         tmp_path, RMTrainer)
    monkeypatch.setattr(RMTrainer, "__init__", edited)
    cp_init.patch(RMTrainer, lambda m: True, lambda t, m: None, "test")  # the seam marks the piece used
    assert versions.installed("llamafactory") == version
    line = f"{RM_INIT} (code CI never saw, llamafactory {version})"
    assert versions.untested() == [line]  # what the guard's messages name
    with pytest.raises(LigerFsdpConfigError) as stop:  # the guard cannot compare an __init__: the run stops
        fingerprints.settle(guard=True)
    assert RM_INIT in str(stop.value) and "liger_fsdp_guard: false" in str(stop.value)
    with caplog.at_level(logging.INFO, logger="llamafactory_liger_fsdp"):
        fingerprints.settle(guard=False)
        fingerprints.settle(guard=False)
    assert len(said(caplog)) == 1 and RM_INIT in said(caplog)[0] and "nothing checks" in said(caplog)[0]


def test_sequence_parallel_loss_changed_under_the_same_version_is_untested_and_stops(tmp_path, caplog):
    from llamafactory_liger_fsdp import guard

    sp = pytest.importorskip(SP)
    edited = edited_copy(sp.sequence_parallel_loss, "value=-100", "value=-1", tmp_path)
    slot = {"sequence_parallel_loss": edited}  # v1's registry entry, holding the changed function
    _patch.put(slot, "sequence_parallel_loss", lambda model, model_inputs: None, "test", "test slot")
    line = f"{SP_LOSS} (code CI never saw, llamafactory {versions.installed('llamafactory')})"
    assert versions.untested() == [line]
    with pytest.raises(LigerFsdpConfigError) as stop:  # where the guard cannot compare it stops, naming the piece
        guard.unchecked(1, "LLaMA-Factory's sequence_parallel_loss", "test")
    assert SP_LOSS in str(stop.value)
    piece = fingerprints.registry()[SP_LOSS]
    with caplog.at_level(logging.INFO, logger="llamafactory_liger_fsdp"):
        if piece.compared:  # the guard holds v1's own against the plugin's on step 1: a line, then its comparison
            fingerprints.settle(guard=True)
            assert len(said(caplog)) == 1 and SP_LOSS in said(caplog)[0]
        else:  # mirrored: nothing could compare it
            with pytest.raises(LigerFsdpConfigError, match="sequence_parallel_loss"):
                fingerprints.settle(guard=True)


def test_env_names_llamafactory_code_ci_never_saw(monkeypatch):
    from llamafactory_liger_fsdp import env_report

    (line,) = env_report.code_lines()
    assert line.startswith("  LLaMA-Factory code: every function the plugin depends on is code CI ran"), line
    data = {k: v for k, v in fingerprints.recorded().items() if k != RM_INIT}
    monkeypatch.setattr(fingerprints, "_DATA", data)
    (line,) = env_report.code_lines()
    assert line.startswith("  LLaMA-Factory code CI never saw") and RM_INIT in line, line


def test_unregistered_use_is_a_developer_error():
    with pytest.raises(KeyError, match="PIECES"):
        fingerprints.use("llamafactory.nowhere:f")


# --------------------------------------------------------------------------- the __init__ seam
TOY = '''
class Base:
    def __init__(self, args, model, renderer, train_dataset, callbacks=None):
        self.seen = args.cp_size


class Trainer(Base):
    def __init__(self, args, model, renderer, train_dataset, callbacks=None):
        """Doc."""
        if args.cp_size > 1:
            raise NotImplementedError("only cp_size == 1")

        self.pref = args.pref
        super().__init__(args, model, renderer, train_dataset, callbacks)
        if self.pref == "boom":
            raise ValueError("line sixteen")
'''


def _toy(tmp_path, text=TOY):
    path = tmp_path / "toy_trainer.py"
    path.write_text(textwrap.dedent(text))
    scope: dict = {"__name__": "toy_trainer"}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return scope["Trainer"], path


def test_seam_runs_init_as_written_without_only_its_refusal(tmp_path):
    from llamafactory_liger_fsdp.integration.v1 import cp_init

    cls, path = _toy(tmp_path)
    built = []
    cp_init.patch(cls, lambda model: model == "taken", lambda t, m: built.append((t, m)), "test")
    args = SimpleNamespace(cp_size=4, pref="sigmoid")
    trainer = cls(args, "taken", None, None)
    assert (trainer.seen, trainer.pref, args.cp_size) == (4, "sigmoid", 4)  # BaseTrainer saw the run's cp_size
    assert built == [(trainer, "taken")]
    with pytest.raises(NotImplementedError):  # a model the plugin does not take: upstream's refusal
        cls(args, "other", None, None)
    with pytest.raises(ValueError) as err:  # tracebacks point at upstream's own file and line
        cls(SimpleNamespace(cp_size=2, pref="boom"), "taken", None, None)
    frame = err.traceback[-1]
    assert frame.path == path and frame.lineno + 1 == 16
    _patch.undo(cls, "__init__")
    with pytest.raises(NotImplementedError):
        cls(args, "taken", None, None)


def test_seam_refuses_an_init_whose_refusal_changed(tmp_path):
    from llamafactory_liger_fsdp.integration.v1 import cp_init

    cls, _ = _toy(tmp_path, TOY.replace("if args.cp_size > 1:", "if args.cp_size > 1 and args.pref:"))
    with pytest.raises(_patch.PatchError, match="cp_size > 1"):
        cp_init.patch(cls, lambda model: True, lambda t, m: None, "test")


@pytest.mark.parametrize("module,name", [("llamafactory.v1.trainers.rm_trainer", "RMTrainer"),
                                         ("llamafactory.v1.trainers.dpo_trainer", "DPOTrainer")])
def test_seam_on_the_installed_trainer(module, name, monkeypatch):
    """The installed trainer's own __init__ (0.9.5's RM reads cp_size from dist_config; git main's DPO and RM from
    args) runs through to BaseTrainer.__init__ with the run's cp_size; the original refuses."""
    cls = getattr(pytest.importorskip(module), name, None)
    if cls is None:
        pytest.skip(f"no v1 {name} in LLaMA-Factory {versions.installed('llamafactory')}")
    from llamafactory.v1.core.base_trainer import BaseTrainer

    from llamafactory_liger_fsdp.integration.v1 import cp_init

    seen = []
    monkeypatch.setattr(BaseTrainer, "__init__", lambda self, args, *rest: seen.append(args.cp_size))
    monkeypatch.setattr(cls, "_init_ref_model", lambda self: None, raising=False)
    args = SimpleNamespace(cp_size=2, dist_config={"cp_size": 2}, pref_loss="sigmoid", pref_beta=0.1, pref_ftx=0.0,
                           simpo_gamma=0.5, ld_alpha=None, dpo_label_smoothing=0.0)
    with pytest.raises(NotImplementedError):
        cls(args, None, None, None)
    cp_init.patch(cls, lambda model: True, lambda t, m: None, "test")
    cls(args, None, None, None)
    assert seen == [2] and args.cp_size == 2 and args.dist_config == {"cp_size": 2}
    assert fingerprints.unseen() == []  # the code CI saw
    assert sys.modules[module].__dict__[name] is cls
