"""The user's arguments as they arrive, before LLaMA-Factory parses them: yes/no values and command lines.

Two readings of "is this value true?", on purpose:

* :func:`true_or_false` -- strict, for the plugin's own keys: a bool, or the string ``true``/``false``; anything else
  is the caller's error (:mod:`.config` names the key and the fix).
* :func:`truthy` -- lenient, for other tools' keys in a raw yaml or argv: ``1``/``true``/``yes``/``on`` in any case;
  anything else is false.
* :func:`env_enabled` -- LLaMA-Factory's environment switches (``USE_MCA``, ``USE_V1``, ...) read as LLaMA-Factory
  reads them: its own ``is_env_enabled`` (``true``/``y``/``1``).

Command lines are read here only: :func:`argv_options` (HfArgumentParser's ``--key value``, ``--key=value``, bare
``--key``), :func:`argv_values` (that, plus yaml/json files and OmegaConf's ``key=value`` overrides: a launcher's
argv) and :func:`read_args` (a training command's arguments as LLaMA-Factory's ``read_args`` reads them). LLaMA-Factory's own parser still decides what is valid. This module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

CONFIG_FILES = (".yaml", ".yml", ".json")


def true_or_false(value: Any) -> bool | None:
    """``True``/``False`` for a bool or the string ``true``/``false`` (any case, spaces around); None otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def truthy(value: Any) -> bool:
    """Whether another tool's switch is on: ``1``/``true``/``yes``/``on`` (any case), ``True``; false otherwise."""
    return str(value).strip().lower() in ("1", "true", "yes", "on")


#: What LLaMA-Factory's ``is_env_enabled`` counts as on (used where LLaMA-Factory is not importable).
ENV_TRUE = ("true", "y", "1")


def env_enabled(name: str, env: Any = None) -> bool:
    """Whether LLaMA-Factory's environment switch ``name`` is on, by its own ``extras.misc.is_env_enabled`` (the
    truth set :data:`ENV_TRUE` where it is not importable, or for another ``env`` mapping)."""
    if env is None:
        try:
            from llamafactory.extras.misc import is_env_enabled
        except Exception:  # no LLaMA-Factory here, or it does not import on this machine
            is_env_enabled = None
        if is_env_enabled is not None:
            return bool(is_env_enabled(name))
        env = os.environ
    return str(env.get(name, "0")).lower() in ENV_TRUE


def read_args(argv: Sequence[str]) -> dict | list:
    """A training command's arguments (after the command) as LLaMA-Factory's ``read_args`` reads them: a yaml/json
    file merged with OmegaConf's ``key=value`` overrides (a dict), otherwise the argv list itself."""
    argv = list(argv)
    if not argv or not isinstance(argv[0], str) or not argv[0].endswith(CONFIG_FILES):
        return argv
    import json
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(argv[0]).absolute()
    if argv[0].endswith(".json"):
        with open(path, encoding="utf-8") as f:
            base = OmegaConf.create(json.load(f))
    else:
        base = OmegaConf.load(path)
    merged = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.from_cli(argv[1:])))
    return merged if isinstance(merged, dict) else {}


class Option(NamedTuple):
    start: int  # index of ``--key`` in the argv
    stop: int  # index after the option (after its value when the value is the next item)
    key: str
    value: str | None  # None: a bare ``--key``


def argv_options(argv: Sequence[Any]) -> Iterator[Option]:
    """The options of an HfArgumentParser argv, in order: ``--key=value``, ``--key value`` (the next item, unless it
    starts with ``--``) and bare ``--key``. Other items (positional, not strings) are passed over."""
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if not (isinstance(item, str) and item.startswith("--")):
            i += 1
            continue
        key, eq, value = item[2:].partition("=")
        stop = i + 1
        if not eq:
            nxt = items[stop] if stop < len(items) else None
            if isinstance(nxt, str) and not nxt.startswith("--"):
                value, stop = nxt, stop + 1
            else:
                value = None
        yield Option(i, stop, key, value)
        i = stop


def argv_values(argv: Sequence[Any]) -> dict[str, Any]:
    """``{key: value}`` of a command line, read leniently and in order (a later value wins): yaml/json files that
    exist, OmegaConf's ``key=value`` overrides, HfArgumentParser's options; a bare ``--key`` or ``key`` is
    ``"true"``. Values are as written (strings from the command line, typed from a file)."""
    items = list(argv)
    options = {o.start: o for o in argv_options(items)}
    out: dict[str, Any] = {}
    i = 0
    while i < len(items):
        item = items[i]
        if i in options:
            option = options[i]
            out[option.key] = "true" if option.value is None else option.value
            i = option.stop
            continue
        i += 1
        if not isinstance(item, str):
            continue
        if item.endswith(CONFIG_FILES) and os.path.isfile(item):
            import yaml  # json is yaml

            with open(item, encoding="utf-8") as f:
                loaded = yaml.safe_load(f)
            out.update(loaded if isinstance(loaded, dict) else {})
        elif "=" in item:
            key, _, value = item.lstrip("-").partition("=")
            out[key] = value
        elif item.lstrip("-"):
            out[item.lstrip("-")] = "true"
    return out
