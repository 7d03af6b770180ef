"""The real-depth benchmark (`bench/depth.py dpo|vlm --smoke`) on the CPU: plain and plugin runs through the bench
launcher, so the script a GPU call needs keeps working. The rows carry the depth table's keys, the engaged line, and
the guard line of each plugin run: exact on the DPO policy's first log-probs and on the VLM's images; and step 2's
profile (bench/step_profile.py), left out of tokens/s, with the host's time in the plugin's head path (none in plain)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("model", "layers", "stage", "sharding", "variant", "cutoff", "images", "fits", "tokens_per_s", "peak_gib",
        "step_losses", "error", "run", "date", "card")


@pytest.mark.parametrize("part", ["dpo", "vlm"])
def test_depth_dpo_vlm_smoke(tmp_path, part):
    out = tmp_path / "rows.json"
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "depth.py"), part, "--smoke", "--runs", "1",
                           "--cutoffs", "128", "--work", str(tmp_path), "--out", str(out), "--profile", "2"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    plain, plugin = rows["plain"], rows["plugin"]
    assert plain["fits"] and plugin["fits"] and plugin["tokens_per_s"] > 0, (plain, plugin)
    assert all(key in plugin for key in KEYS)
    assert plugin["stage"] == ("dpo" if part == "dpo" else "sft") and plugin["images"] == (part == "vlm")
    assert abs(plugin["step_losses"][0] - plain["step_losses"][0]) <= 1e-5 * abs(plain["step_losses"][0])
    model = "LlamaForCausalLM" if part == "dpo" else "Qwen2_5_VLForConditionalGeneration"
    assert plugin["engaged"].startswith("[liger_fsdp] engaged: head=modules_to_save (lm_head)") and model in plugin["engaged"]
    assert plugin["guard"].startswith("[liger_fsdp] guard: step 1 exact") and plain["engaged"] is None
    if part == "vlm":
        assert "(decoder on the whole micro-batch)" in plugin["guard"]  # pixel values and grids went in
    assert "targets:" in proc.stdout
    assert plain["profile"]["head_cpu_ms"] == 0 < plugin["profile"]["head_cpu_ms"] < plugin["profile"]["step_ms"]
    assert "profile plugin 128 r1: step" in proc.stdout
    times = plugin["step_times"]  # 3 steps; step 2 profiled: tokens/s from step 3 alone
    assert plugin["step_s"] == times[2], times
