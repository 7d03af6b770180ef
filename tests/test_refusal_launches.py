"""Refusals before any rank starts, through the real launchers: `USE_MCA=y` (LLaMA-Factory's own reading of the
switch; mcore_adapter stood in by a stub package) as a yaml and as `--key value` arguments of `llamafactory-cli train`,
and a misspelled key under `accelerate launch` and a bare `torchrun` -- each one message, printed once, as the last
line, exit 1, and no rank started; a guard stop in the ranks printed last by the launching process (bare torchrun,
llamafactory-cli). The rules themselves are tested in process in test_refusal_paths.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.cli import base_yaml

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _run(command: list[str], tmp_path: Path, **env) -> tuple[int, str]:
    full = dict(os.environ, OMP_NUM_THREADS="1", PATH=str(BIN) + os.pathsep + os.environ.get("PATH", ""),
                HF_HOME=str(tmp_path / "hf_home"), **env)  # HF_HOME: no accelerate default config of this machine
    full.pop("ALLOW_EXTRA_ARGS", None)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=full, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr


def _refused_once_and_last(rc: int, log: str, start: str) -> None:
    lines = [line for line in log.splitlines() if line.strip()]
    assert rc == 1, log[-4000:]
    assert lines and lines[-1].startswith(start), log[-4000:]
    assert sum("[liger_fsdp] error" in line for line in lines) == 1, log[-4000:]
    assert "Traceback" not in log and "Initializing" not in log and "ChildFailedError" not in log, log[-4000:]


@pytest.fixture
def mcore_stub(tmp_path):
    stub = tmp_path / "stub" / "mcore_adapter"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        '"""TEST-ONLY stand-in: makes mcore_adapter importable (LLaMA-Factory imports these names under USE_MCA)."""\n'
        "from transformers import Seq2SeqTrainingArguments, TrainingArguments\n")
    return str(stub.parent)


@pytest.mark.parametrize("form", ["yaml", "argv"])
def test_use_mca_y_refused_before_any_rank(assets, tmp_path, mcore_stub, form):
    cfg = base_yaml(assets, tmp_path / "out", liger_fsdp=True)
    if form == "yaml":
        path = tmp_path / "sft.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args = [str(path)]
    else:
        args = [item for k, v in cfg.items() for item in (f"--{k}", str(v))]
    rc, log = _run([str(BIN / "llamafactory-cli"), "train", *args], tmp_path, USE_MCA="y", PYTHONPATH=mcore_stub,
                   NPROC_PER_NODE="2")
    _refused_once_and_last(rc, log, "[liger_fsdp] error: `liger_fsdp: true` does not work with USE_MCA=y")


def test_typo_under_accelerate_launch_is_one_message_last(assets, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "out", liger_fsdp=True, liger_fsdp_gaurd=True)))
    rc, log = _run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                    "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "llamafactory.launcher", str(path)],
                   tmp_path, CUDA_VISIBLE_DEVICES="")
    _refused_once_and_last(rc, log, "[liger_fsdp] error: Unknown key(s) `liger_fsdp_gaurd`")


def test_typo_under_a_bare_torchrun_is_one_message_last(assets, tmp_path):
    """torchrun itself (no LLaMA-Factory launcher to check first): the torchrun process checks the arguments before
    it starts any rank, as `llamafactory-cli` and `accelerate launch` do."""
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(base_yaml(assets, tmp_path / "out", liger_fsdp=True, liger_fsdp_gaurd=True)))
    import llamafactory.launcher

    rc, log = _run([str(BIN / "torchrun"), "--nproc_per_node", "2", llamafactory.launcher.__file__, str(path)],
                   tmp_path, CUDA_VISIBLE_DEVICES="")
    _refused_once_and_last(rc, log, "[liger_fsdp] error: Unknown key(s) `liger_fsdp_gaurd`")


INJECT = Path(__file__).resolve().parent / "v1_stop_inject"


@pytest.mark.parametrize("launcher", ["torchrun", "llamafactory-cli"])
def test_guard_stop_in_the_ranks_is_the_last_thing_read(assets, tmp_path, launcher):
    """v1, 2 ranks, a 1% error in the plugin's log-probs (tests/v1_stop_inject): the guard stops step 1 on every rank;
    the ranks hand the stop to the launching process, which prints it after the launch ended -- no traceback per
    rank, no ChildFailedError / Root Cause block, no CalledProcessError -- under a bare torchrun (the v1 launcher's
    file) and under `llamafactory-cli` (its torchrun nested inside)."""
    pytest.importorskip("llamafactory.v1")
    import llamafactory.v1.launcher

    from support.v1 import SHIM, v1_yaml

    out = tmp_path / "stop"
    path = tmp_path / "stop.yaml"
    path.write_text(yaml.safe_dump(v1_yaml(assets, out, max_steps=1)))
    command = ([str(BIN / "torchrun"), "--nproc_per_node", "2", llamafactory.v1.launcher.__file__, "sft", str(path)]
               if launcher == "torchrun" else [str(BIN / "llamafactory-cli"), "sft", str(path)])
    rc, log = _run(command, tmp_path, CUDA_VISIBLE_DEVICES="", USE_V1="1", FORCE_TORCHRUN="1", NPROC_PER_NODE="2",
                   PYTHONPATH=os.pathsep.join([str(INJECT), str(SHIM)]))
    lines = [line for line in log.splitlines() if line.strip()]
    stops = [i for i, line in enumerate(lines) if line.startswith("[liger_fsdp] error: `liger_fsdp_guard`: on step ")]
    assert rc == 1 and stops, log[-6000:]
    assert stops == list(range(len(lines) - len(stops), len(lines))), log[-6000:]  # the last lines read
    assert {re.search(r"rank (\d)", lines[i]).group(1) for i in stops} == {"0", "1"}, log[-6000:]
    for noise in ("Traceback", "ChildFailedError", "Root Cause", "CalledProcessError", "LigerFsdpConfigError"):
        assert noise not in log, log[-6000:]
