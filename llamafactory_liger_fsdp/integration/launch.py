"""The launching processes of :mod:`.`: what the arguments alone decide is refused there, before any rank starts, as
one message printed once and last (exit 1); the ranks check again after parsing (:mod:`.llamafactory`), and a refusal
there is one message from rank 0, not a traceback per rank (:func:`.._log.one_message_per_run`).

* ``llamafactory.launcher.launch`` -- ``llamafactory-cli train <yaml|json|--key value ...>`` (hooked module).
* ``torch.distributed.run.run`` -- a bare ``torchrun`` (and ``accelerate launch``'s multi-process launch): the same
  check of the training script's arguments where no outer launcher made it (:func:`patch_torchrun`).
* ``accelerate.commands.launch.launch_command`` -- ``accelerate launch ... -m llamafactory.launcher <args>`` (hooked
  module; the ``.pth`` hook runs in the ``accelerate`` CLI too): the training script's arguments are checked when
  they carry a ``liger_fsdp`` key; a v1 command (``-m llamafactory.v1.launcher sft <yaml>``, or LLaMA-Factory's CLI
  under ``USE_V1=1``) as v1's launcher checks it.

What a launcher said once (the untested-versions line) is handed to its ranks for that launch only
(:func:`.._log.handed_on`); a refusal or guard stop in its ranks is handed back and printed last (:mod:`.stop`, which
also hooks ``torchrun`` itself).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

from .. import _log, _patch, refusals, sharding, versions
from ..args import read_args
from ..checkpoint import resume
from ..config import LigerFsdpConfigError
from . import stop
from .common import refused


def precheck(raw: Any) -> None:
    """What the arguments alone decide (a dict from yaml/json, or an argv list), checked in the launching process with
    the rules every rank applies after parsing."""
    from .v1 import args as v1_args
    from .common import SAID_VERSIONS
    from .llamafactory import check_family, config_from_args

    v1_args.without_v1(raw)
    rest, cfg = config_from_args(raw)
    if not cfg.enabled:
        return
    if not isinstance(rest, dict):
        from ..args import argv_values

        rest = argv_values(rest)
    args = SimpleNamespace(**{k: rest.get(k) for k in ("deepspeed", "fsdp", "fsdp_config")})
    decided = sharding.decide(args)
    refusals.check_raw(rest, decided, cfg)
    resume.refuse_sharded_state_dict(decided, SimpleNamespace(finetuning_type=rest.get("finetuning_type", "lora")))
    if rest.get("resume_from_checkpoint"):
        resume.check_resume(SimpleNamespace(resume_from_checkpoint=rest["resume_from_checkpoint"]))
    try:
        check_family(SimpleNamespace(**{k: v for k, v in rest.items() if isinstance(k, str)}))
    except LigerFsdpConfigError:
        raise
    except Exception:  # config not readable here (hub id offline, ...): checked again at load time
        pass
    _log.say_once(SAID_VERSIONS, versions.note(cfg.guard))


def patch_launcher(launcher_module: Any) -> None:
    _patch.require_params(launcher_module.launch, (), "launch")

    def make(original):
        def launch():
            _log.new_run()
            if sys.argv[1:2] == ["train"]:
                try:
                    precheck(read_args(sys.argv[2:]))
                except LigerFsdpConfigError as exc:
                    refused(exc)
            with _log.handed_on():
                return stop.run_collecting(original)

        return launch

    _patch.apply(launcher_module, "launch", make, "refuse what the arguments alone decide before any rank starts")


def _carries_our_keys(raw: Any) -> bool:
    from ..args import argv_values

    values = raw if isinstance(raw, dict) else argv_values(raw)
    return any(isinstance(k, str) and k.startswith("liger_fsdp") for k in values)


def _runs_v1(script: str, script_args: list) -> bool:
    """A v1 training command (``sft``, ``dpo``, ...) run by v1's launcher (``-m llamafactory.v1.launcher`` or its
    file), or by LLaMA-Factory's CLI under USE_V1."""
    from ..args import env_enabled
    from .v1.engine import COMMANDS

    v1_launcher = script.startswith("llamafactory.v1") or script.replace(os.sep, "/").endswith(
        "llamafactory/v1/launcher.py")
    return bool(script_args[:1]) and script_args[0] in COMMANDS and (v1_launcher or env_enabled("USE_V1"))


def _precheck_v1(script_args: list) -> None:
    from .v1 import engine as v1_engine

    try:
        v1_engine.precheck(script_args[0], script_args[1:])
    except LigerFsdpConfigError:
        raise
    except Exception:  # a yaml not readable here: v1's launcher in each rank says why, the ranks check again
        pass


def _precheck_script(script_args: list) -> None:
    script_args = script_args[1:] if script_args[:1] == ["train"] else script_args  # llamafactory-cli's
    try:
        raw = read_args(script_args)
    except Exception:  # not arguments LLaMA-Factory reads (another script's): accelerate goes on as usual
        return
    if _carries_our_keys(raw):
        precheck(raw)


def precheck_script(script: str, script_args: list) -> None:
    """The arguments of a training script that a launcher (``accelerate launch``, ``torchrun``) starts: checked as
    the engine's own launcher checks them (v1: :func:`.v1.engine.precheck`)."""
    if _runs_v1(script, script_args):
        _precheck_v1(script_args)
    else:
        _precheck_script(script_args)


def patch_accelerate_launch(launch_module: Any) -> None:
    """``accelerate launch``: the training script's arguments checked before accelerate starts any process."""
    _patch.require_params(launch_module.launch_command, ("args",), "accelerate launch_command")

    def make(original):
        def launch_command(args):
            _log.new_run()
            script_args = list(getattr(args, "training_script_args", None) or [])
            try:
                precheck_script(str(getattr(args, "training_script", "") or ""), script_args)
            except LigerFsdpConfigError as exc:
                refused(exc)
            with _log.handed_on():
                return stop.run_collecting(original, args)

        return launch_command

    _patch.apply(launch_module, "launch_command", make,
                 "accelerate launch: refuse what the training arguments alone decide before any rank starts")


def patch_torchrun(run_module: Any) -> None:
    """``torch.distributed.run.run`` (``torchrun``, and ``accelerate launch``'s multi-process launcher): the
    training script's arguments checked first where no outer launcher did, the ranks' stops printed last."""
    _patch.require_params(run_module.run, ("args",), "torchrun run")

    def make(original):
        def run(args):
            if os.environ.get(stop.ENV):  # started by a launcher that checked the arguments and prints the stops
                return stop.run_collecting(original, args)
            _log.new_run()
            try:
                precheck_script(str(getattr(args, "training_script", "") or ""),
                                list(getattr(args, "training_script_args", None) or []))
            except LigerFsdpConfigError as exc:
                refused(exc)
            with _log.handed_on():
                return stop.run_collecting(original, args)

        return run

    _patch.apply(run_module, "run", make, "torchrun: refuse what the arguments alone decide before any rank starts; "
                                          "the ranks' stops printed last")
