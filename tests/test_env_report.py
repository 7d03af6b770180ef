"""`python -m llamafactory_liger_fsdp env`: the bug-report paste, run as a user runs it (a fresh interpreter, no GPU).

The run pretends a newer transformers is installed (tests/newer_library_shim), so the report must name it as newer
than tested and say that LLaMA-Factory's own start-up check stops it unless DISABLE_VERSION_CHECK=1.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import llamafactory_liger_fsdp
from llamafactory_liger_fsdp import env_report, versions

ROOT = Path(__file__).resolve().parent.parent
SHIM = str(ROOT / "tests" / "newer_library_shim")


def _env_report(**env) -> tuple[int, list[str]]:
    run_env = {k: v for k, v in os.environ.items() if k not in ("DISABLE_VERSION_CHECK", "PYTHONPATH")}
    run_env.update(CUDA_VISIBLE_DEVICES="", **env)
    proc = subprocess.run([sys.executable, "-m", "llamafactory_liger_fsdp", "env"], capture_output=True, text=True,
                          env=run_env, cwd=str(ROOT), timeout=120)
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


@pytest.fixture(scope="module")
def report():
    return _env_report(PYTHONPATH=SHIM, NEWER_LIBRARY_VERSION="5.99.0")


def _line(lines: list[str], start: str) -> str:
    hits = [line.strip() for line in lines if line.strip().startswith(start)]
    assert len(hits) == 1, (start, lines)
    return hits[0]


def test_env_names_plugin_and_every_checked_library(report):
    rc, lines = report
    assert rc == 0, lines
    assert lines[0] == f"llamafactory-liger-fsdp {llamafactory_liger_fsdp.__version__}"
    for name in versions.MINIMUM:
        line = _line(lines, name + " ")
        installed = versions.installed(name) if name != "transformers" else "5.99.0"
        assert line.split()[1] == (installed or "-"), line
        assert f" {versions.MINIMUM[name]} " in line and f" {versions.TESTED[name]} " in line, line
    assert _line(lines, "transformers ").endswith("newer than tested: trains, the first-step guard checks the loss")
    torch_line = _line(lines, "torch ")
    assert torch_line.endswith(env_report.verdict("torch", versions.installed("torch"))), torch_line


def test_env_says_what_llamafactory_own_check_does(report):
    _, lines = report
    check = _line(lines, "LLaMA-Factory's own version check:")
    assert "transformers 5.99.0 (LLaMA-Factory requires transformers>=" in check, check
    assert check.endswith("llamafactory-cli stops at start; DISABLE_VERSION_CHECK=1 skips that check"), check


def test_env_device_backend_and_hook_without_gpu(report):
    _, lines = report
    assert _line(lines, "device:").startswith("device: cpu ("), lines
    assert _line(lines, "liger_fsdp_backend auto ->") == "liger_fsdp_backend auto -> torch"
    assert _line(lines, "import hook:").startswith("import hook: active"), lines
    assert _line(lines, "CUDA_VISIBLE_DEVICES=") == "CUDA_VISIBLE_DEVICES="


def test_verdicts():
    assert env_report.verdict("torch", "2.9.1") == "too old: refused with liger_fsdp: true (needs >= 2.11)"
    assert env_report.verdict("torch", "2.11.0") == "tested"
    assert env_report.verdict("peft", "0.99.0").startswith("newer than tested")
    assert env_report.verdict("peft", None) == "not installed"
