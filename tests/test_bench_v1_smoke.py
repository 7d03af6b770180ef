"""The v1 benchmark (`bench/v1.py --smoke`) on the CPU: v1's own runs and the plugin's through the bench launcher
(`bench/lf_bench_launch.py v1`), so the script a GPU call needs keeps working. The rows carry what the v1 figure needs:
tokens/s, peak, step losses (the plugin's equal to v1's), the engaged and guard lines. With the seed's adapter the
plugin trains whether or not v1 alone does (LLaMA-Factory 0.9.5's v1 shards the embedding copy twice and stops)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llamafactory.v1")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_v1_bench_smoke(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "v1.py"), "--smoke", "--runs", "1", "--variants",
                           "plain,plain-head,plugin", "--work", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    seed, head, plugin = rows["plain"], rows["plain-head"], rows["plugin"]
    if seed["fits"]:  # v1 alone trains the seed's adapter: the plugin's losses are its losses
        assert abs(plugin["step_losses"][0] - seed["step_losses"][0]) < 1e-5 * abs(seed["step_losses"][0])
    else:  # it stops, naming its own FSDP2 wrapping: the row keeps the reason
        assert "fully_shard" in seed["error"], seed["error"]
    assert head["fits"] and plugin["fits"] and head["tokens_per_s"] > 0 and plugin["tokens_per_step"] > 0
    assert abs(plugin["step_losses"][0] - head["step_losses"][0]) < 1e-5 * abs(head["step_losses"][0])
    assert plugin["engaged"].startswith("[liger_fsdp] engaged: head=modules_to_save (lm_head)")
    assert plugin["guard"].startswith("[liger_fsdp] guard: step 1 exact") and head["engaged"] is None
    for key in ("model", "variant", "scenario", "cutoff_len", "fits", "tokens_per_s", "peak_gib", "step_losses", "run",
                "date", "card", "versions"):
        assert key in plugin, key
