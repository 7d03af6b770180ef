"""LlamaBoard users (LLaMA-Factory's web UI, `llamafactory-cli webui`): the plugin's lines reach what the page shows
(running_log.txt while the run trains, stderr when it fails), a false value survives the page when written as the
string "false", and the whole path in a real browser (headless Chromium on a local LlamaBoard): the tiny CPU model
typed into the Train tab with `{"liger_fsdp": true}` trains with the engaged and the guard's "exact" lines on the
page, and a refused setting shows its one message in the failure box."""

from __future__ import annotations

import io
import json
import logging
import os
import sys

import pytest

from llamafactory_liger_fsdp import _log
from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from support import llamaboard
from support.cli import base_yaml, run_cli

ENGAGED = "[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=none"
EXACT = "[liger_fsdp] guard: step 1 exact: model's own loss"


@pytest.fixture
def running_log(tmp_path, monkeypatch):
    """LLaMA-Factory's own LoggerHandler on its logger, as its LogCallback adds it in web UI mode (after the parse);
    a stream handler beside it stands for its terminal handler. Yields a function reading running_log.txt."""
    from llamafactory.extras import logging as lf_logging

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    terminal = io.StringIO()
    stream = logging.StreamHandler(terminal)
    theirs = logging.getLogger(_log.THEIRS)
    theirs.addHandler(stream)
    added = []

    def add():
        handler = lf_logging.LoggerHandler(str(tmp_path))
        lf_logging.add_handler(handler)
        added.append(handler)

    def read():
        for handler in added:
            handler.thread_pool.shutdown(wait=True)  # its writes are queued on a thread
        return (tmp_path / "running_log.txt").read_text()

    try:
        yield add, read, terminal
    finally:
        theirs.removeHandler(stream)
        for handler in added:
            lf_logging.remove_handler(handler)


def test_lines_reach_llamaboards_running_log_once(running_log, capsys):
    add, read, terminal = running_log
    _log.new_run()
    _log.say_once("test-said", "[liger_fsdp] said before the page's handler was added")
    add()
    _log.info_rank0("[liger_fsdp] said after")
    text = read()
    lines = [line for line in text.splitlines() if "[liger_fsdp]" in line]
    assert len(lines) == 2 and "said before" in lines[0] and "said after" in lines[1], text
    assert all(" test_llamaboard.py:" in line for line in lines), lines  # the module that said it, as LLaMA-Factory's
    err = capsys.readouterr().err
    assert err.count("[liger_fsdp] said before") == 1 and err.count("[liger_fsdp] said after") == 1, err
    assert "[liger_fsdp]" not in terminal.getvalue()  # the terminal gets each line once (the plugin's stderr)


def test_a_new_run_does_not_hand_the_last_runs_lines_to_a_new_handler(running_log):
    add, read, _ = running_log
    _log.new_run()
    _log.info_rank0("[liger_fsdp] the last run's line")
    _log.new_run()
    add()
    _log.info_rank0("[liger_fsdp] this run's line")
    text = read()
    assert "this run's line" in text and "the last run's line" not in text, text


@pytest.fixture
def excepthook(monkeypatch):
    """sys.excepthook as a single process has it after a run started (the previous hook records what it gets)."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LLAMABOARD_ENABLED"):
        monkeypatch.delenv(key, raising=False)
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    _log.new_run()
    return seen


def _end_on(exc):
    try:
        raise exc
    except Exception as raised:
        sys.excepthook(type(raised), raised, raised.__traceback__)


GUARD_STOP = ("`liger_fsdp_guard`: on step 1 the fused loss is not the model's own for model type `llama` "
              "(LlamaForCausalLM), rank 0: model's own loss 5.9, fused loss 6.0. Fix: remove `liger_fsdp` "
              "(`liger_fsdp_guard: false` skips the check).")


def test_the_plugins_error_ends_one_process_as_its_one_message(excepthook, capsys):
    _end_on(LigerFsdpConfigError(GUARD_STOP))
    assert capsys.readouterr().err == f"[liger_fsdp] error: {GUARD_STOP}\n" and not excepthook
    _end_on(RuntimeError("not the plugin's"))  # anything else: the previous hook (its traceback)
    assert [type(e) for e in excepthook] == [RuntimeError]


def test_in_llamaboard_the_message_is_wrapped_and_says_how_to_write_false(excepthook, capsys, monkeypatch):
    monkeypatch.setenv("LLAMABOARD_ENABLED", "1")
    _end_on(LigerFsdpConfigError(GUARD_STOP))
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("[liger_fsdp] error: `liger_fsdp_guard`") and max(map(len, lines)) <= 100, err
    assert " ".join(line.strip() for line in lines).startswith(f"[liger_fsdp] error: {GUARD_STOP} "), err
    assert '{"liger_fsdp_guard": "false"}' in " ".join(lines), err


def test_a_false_written_as_the_string_false_survives_the_page(tmp_path):
    """LlamaBoard writes the command it runs without the keys set to false; the string "false" stays, and the plugin
    reads it as false."""
    common = pytest.importorskip("llamafactory.webui.common")
    from llamafactory_liger_fsdp.args import read_args  # `llamafactory-cli train <yaml>` reads it so
    from llamafactory_liger_fsdp.integration.llamafactory import config_from_args

    args = dict(output_dir=str(tmp_path), liger_fsdp=True, liger_fsdp_guard="false", liger_fsdp_memory_report=False)
    raw = read_args([common.save_cmd(args)])
    assert "liger_fsdp_memory_report" not in raw  # dropped by the page
    _, cfg = config_from_args(raw, say=False)
    assert cfg.enabled and cfg.guard is False


# --------------------------------------------------------------------------------------------- processes
@pytest.mark.slow
def test_a_web_ui_run_writes_the_plugin_lines_into_running_log(assets, tmp_path):
    """`llamafactory-cli train` as LlamaBoard starts it (LLAMABOARD_ENABLED=1, LLAMABOARD_WORKDIR): running_log.txt
    (what the page shows) holds the engaged line and the guard's verdict, once each; the terminal too."""
    out = tmp_path / "out"
    env = {"LLAMABOARD_ENABLED": "1", "LLAMABOARD_WORKDIR": str(out)}
    rc, log, losses = run_cli(base_yaml(assets, out, liger_fsdp=True, max_steps=2), extra_env=env)
    assert rc == 0 and len(losses) == 2, log[-4000:]
    text = (out / "running_log.txt").read_text()
    for line in (ENGAGED, EXACT):
        assert text.count(line) == 1, text[-4000:]
        assert log.count(line) == 1, log[-4000:]


@pytest.mark.slow
def test_llamaboard_in_a_browser(assets, tmp_path):
    """One page load, two runs: the tiny model with `liger_fsdp` trains (the engaged and "exact" lines on the page,
    "Finished."), then the same with the Booster set to unsloth is refused (the one message in the failure box).
    LLAMABOARD_SCREENSHOT=<png> keeps a screenshot of the page during the first run (docs/usage.md's)."""
    why = llamaboard.missing()
    if why:
        if os.environ.get("LLF_LIGER_FSDP_REQUIRE_BROWSER") == "1":  # CI (.ci/run): the browser must be there
            pytest.fail(why)
        pytest.skip(why)
    shot = os.environ.get("LLAMABOARD_SCREENSHOT")
    extra = {"liger_fsdp": True, "use_cpu": True, "max_steps": 2, "logging_steps": 1, "preprocessing_num_workers": 1}
    with llamaboard.webui(tmp_path) as (url, server_log), llamaboard.chromium() as driver:
        page = llamaboard.Page(driver, url)
        page.choose("Model name", "Custom")
        page.type("Model path", str(assets / "model"))
        page.choose("Chat template", "llama3")
        page.choose("Compute type", "fp32")
        page.type("Data dir", str(assets / "data"))
        page.choose("Dataset", "tiny_alpaca")
        page.click("LoRA configurations")
        page.type("Additional modules (optional)", "embed_tokens,lm_head")
        page.click("Extra configurations")
        page.type("Extra arguments", json.dumps(extra))
        text = page.run_until_done(240, shot=shot and os.path.abspath(shot), shot_when="[liger_fsdp] guard:")
        context = f"{text[-3000:]}\n--- webui log:\n{server_log.read_text()[-3000:]}"
        assert text.startswith("Finished."), context
        assert text.count(ENGAGED) == 1 and text.count(EXACT) == 1, context

        page.choose("Booster", "unsloth")
        text = page.run_until_done(120)
        context = f"{text[-3000:]}\n--- webui log:\n{server_log.read_text()[-3000:]}"
        assert text.startswith("Failed. Exit code: 1"), context
        assert text.count("[liger_fsdp] error: ") == 1, context  # stderr, shown as it ends: the message last
        message = text[text.index("[liger_fsdp] error: "):].strip()
        assert "use_unsloth" in message and "Fix:" in message and "Traceback" not in text, context
