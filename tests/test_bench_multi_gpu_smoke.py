"""The seed's crash and its fix, through LLaMA-Factory's own training loop on 2 CPU ranks (gloo),
driven by the multi-GPU benchmark script (`bench/multi_gpu_fsdp.py --cpu-smoke`), so the script that
the 2-GPU run needs is kept working too.

* Without the plugin, `enable_liger_kernel: true` (Liger's fused loss) under FSDP1 with PEFT's wrap
  policy crashes on a Qwen2 head: `size mismatch ... vec (<V*H/2>)` with `use_orig_params: true`,
  the in-place view error with `use_orig_params: false`.
* `liger_fsdp: true` beside `enable_liger_kernel: true` trains, and its per-step losses equal the
  plain (unfused) run's; the FSDP1 curve of `liger_fsdp: true` equals the plain one (FSDP2: test_e2e_checkpoints).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("liger_kernel")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("multi_gpu_smoke")
    out = work / "rows.json"
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("ALLOW_EXTRA_ARGS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "multi_gpu_fsdp.py"), "--cpu-smoke", "--parts", "repro,curves", "--fsdp", "1",
         "--work", str(work), "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["part"], r["label"], r["fsdp_version"]): r for r in json.loads(out.read_text())}
    return rows, proc.stdout


def test_liger_flce_crashes_without_the_plugin(smoke):
    rows, _ = smoke
    orig = rows[("repro", "liger_origtrue", 1)]
    assert orig["rc"] != 0
    # the tiny Qwen2 head is 384 x 64, sharded over 2 ranks: the fused loss sees the flat 1-D shard
    assert "RuntimeError: size mismatch, got input (" in orig["error_line"]
    assert "vec (12288)" in orig["error_line"], orig["error_line"]
    flat = rows[("repro", "liger_origfalse", 1)]
    assert flat["rc"] != 0
    assert "is a view and its base or another view of its base has been modified inplace" in flat["error_line"]


def test_plugin_beside_liger_trains_exactly(smoke):
    rows, _ = smoke
    fixed = rows[("repro", "liger+liger_fsdp", 1)]
    assert fixed["rc"] == 0, fixed.get("error_line")
    assert fixed["engaged"].startswith("[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=FSDP1")
    plain = rows[("curves", "plain", 1)]
    assert len(fixed["step_losses"]) >= 2
    for a, b in zip(fixed["step_losses"], plain["step_losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.parametrize("version", [1])  # FSDP2 curves: tests/test_e2e_checkpoints.py (flag on vs off, 6 steps)
def test_curves_match_plain(smoke, version):
    rows, stdout = smoke
    ours = rows[("curves", "liger_fsdp", version)]
    plain = rows[("curves", "plain", version)]
    assert plain["rc"] == 0 and ours["rc"] == 0
    assert f"sharding=FSDP{version}" in ours["engaged"]
    assert plain["engaged"] is None
    assert len(ours["step_losses"]) == len(plain["step_losses"]) == 3
    assert ours["max_rel_diff_vs_plain"] <= 1e-5
    assert "loss curve max rel diff vs plain" in stdout  # the printed table
