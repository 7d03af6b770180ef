"""The CPU memory twin's scripts run end to end (bench/speed.py --twin for LLaMA-Factory, bench/v1.py --twin for
v1) at scale 64 on one CPU rank: a row per variant with a peak and its three phases, the set-up's peak, the live
allocations at both, the package's sizes divided (its log line) -- plumbing only; bench/RESULTS.md section 12 has the
figures."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(path):
    with open(path) as f:
        return json.load(f)["rows"]


def _check(row, scale):
    assert row.get("fits", True) and "error" not in row, row.get("error")
    assert row["twin"] == scale and row["card"] == "cpu"
    phases = [row[f"{p}_peak_gib"] for p in ("forward", "backward", "optimizer")]
    assert all(p > 0 for p in phases) and abs(max(phases) - row["peak_gib"]) <= 0.05 * row["peak_gib"], row
    assert row["live_at_peak"] and all(g["each_gib"] > 0 and g["count"] >= 1 for g in row["live_at_peak"])
    # the set-up (before step 1) is its own window: the model's weights are live in it
    assert 0 < row["setup_peak_gib"] and row["live_at_setup"], row.get("setup_peak_gib")


def _bench(script, tmp_path, *args):
    """Run bench/SCRIPT with ``args`` (4096 tokens, 2 steps, a row file and work folder under tmp_path); its rows."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args, "--cutoff", "4096", "--steps",
                           "2", "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return _rows(out)


def test_memory_twin_llamafactory(tmp_path):
    rows = _bench("speed.py", tmp_path, "--twin", "64", "--layers", "1", "--variants", "plain,liger_fsdp")
    assert [r["variant"] for r in rows] == ["plain", "liger_fsdp"]
    for row in rows:
        _check(row, 64)
    assert rows[1]["engaged"] and "sharding=FSDP2" in rows[1]["engaged"], rows[1]["engaged"]
    log = open(rows[1]["log"]).read()
    assert "[lf_bench] twin 1/64: ops.triton_common.FAST_CHUNK_ROWS=48" in log


def test_memory_twin_v1(tmp_path):
    (row,) = _bench("v1.py", tmp_path, "--twin", "64", "--runs", "1", "--variants", "plugin-head")
    _check(row, 64)
    assert "backend=triton_fast" in row["engaged"] and "guard:" in row["guard"]
    assert "ops.triton_rows.FAST_STORE_MAX_BYTES=262144" in row["twin_constants"]
