"""bench/twin_cp.py, the CPU memory twin of v1 SFT under Ulysses: the committed rows cover what the README and
bench/RESULTS.md read (cp 1/2 at 128k, per LLaMA-Factory: v1 plain, v1 plain with each layer a unit where v1 wraps the
whole model, the plugin; each a 32-layer H200 prediction with its fits flag), and the script turns held twin runs into
those rows by the affine-in-depth extrapolation (no launch: the runs are given).
The launch itself (``bench/v1.py --twin --cp``) is the slow test at the end."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "cpu_twin_cp.json")
CPS = (1, 2)  # the cp sizes the rows cover at 128k tokens a step, on 0.9.5 (with the layer fix) and git main


@pytest.mark.parametrize("lf, variants", [("0.9.5", ("plain", "plain-layers", "plugin")),  # plain: one unit
                                         ("0.9.6.dev0", ("plain", "plugin"))])  # git main wraps each layer itself
def test_committed_rows_cover_the_grid(lf, variants):
    with open(RESULTS) as f:
        rows = [r for r in json.load(f)["rows"] if r["llamafactory"] == lf]
    grid = {(r["cp_size"], r["tokens"], r["variant"]): r for r in rows}
    assert len(grid) == len(rows), "one row per cp_size x tokens x variant"
    for cp in CPS:
        for variant in variants:
            row = grid[(cp, 131072, variant)]
            assert row["peak_gib_per_rank"] > 0 and row["fits"] == (row["peak_gib_per_rank"] <= row["card_gib"])
            assert row["layers"] == 32 and len(row["ranks_gib"]) == cp
            assert ("measured_peak_gib_per_rank" in row) == ("card" in row)
            assert row["layer_units"] == (variant != "plain" or lf != "0.9.5"), row  # as v1 logged it
    for variant in variants:  # more ranks, less a rank
        peaks = [grid[(cp, 131072, variant)]["peak_gib_per_rank"] for cp in CPS]
        assert peaks == sorted(peaks, reverse=True), (variant, peaks)
    assert not grid[(1, 131072, "plain")]["fits"]  # v1's fp32 logits alone: 131072 x 128256 x 4 bytes = 63 GiB, x 3


def _run_row(cp, depth, variant, peaks, first, lf):
    """A bench/v1.py twin row: each rank's peak (step 2's) and its step-1 peak; v1 wrapped each decoder layer."""
    return {"twin": 32, "cp_size": cp, "cutoff_len": 4096, "micro_batch_size": 2, "layers": depth,
            "variant": variant, "fits": True, "peak_gib": max(peaks), "peak_gib_per_rank": peaks,
            "step_peaks_gib_per_rank": [[f, p] for f, p in zip(first, peaks)], "layer_units": True,
            "versions": {"llamafactory": lf}}


def test_rows_from_held_runs_extrapolate_in_depth(tmp_path, monkeypatch):
    """Each rank: the mean over the two depths of its peak there + (32 - depth) x (plain's per-layer increment at cp 1
    / cp + the variant's excess over plain at cp 1, whole; of the step-1 peaks); the ranks' highest. The increment
    measured at cp 2 itself rides along."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import twin_cp
    finally:
        sys.path.pop(0)
    runs = tmp_path / "runs.json"
    lf = twin_cp.LF
    held = [_run_row(1, 1, "plain-head", [20.0], [19.0], lf), _run_row(1, 2, "plain-head", [21.0], [20.0], lf),
            _run_row(1, 1, "plugin-head", [8.0], [7.0], lf), _run_row(1, 2, "plugin-head", [9.0], [8.5], lf),
            _run_row(2, 1, "plain-head", [10.0, 10.5], [9.0, 9.0], lf),
            _run_row(2, 2, "plain-head", [13.0, 9.5], [12.0, 9.5], lf),
            _run_row(2, 1, "plugin-head", [4.0, 4.0], [3.0, 3.0], lf),
            _run_row(2, 2, "plugin-head", [4.5, 4.5], [3.5, 3.5], lf),
            dict(_run_row(2, 2, "plugin-head", [0.5, 0.5], [0.5, 0.5], lf), superseded="before a fix"),
            _run_row(2, 2, "plugin-head", [0.5, 0.5], [0.5, 0.5], "0.0.1")]  # another LLaMA-Factory's
    runs.write_text(json.dumps({"rows": held}))
    launch, run = twin_cp.V1, subprocess.run
    monkeypatch.setattr(twin_cp.subprocess, "run", lambda cmd, **kw: pytest.fail(f"launched {cmd} though it was held")
                        if launch in cmd else run(cmd, **kw))
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"rows": [{"llamafactory": "0.0.1", "variant": "kept"}, {"variant": "dropped"}]}))
    monkeypatch.setattr(sys, "argv", ["twin_cp.py", "--cps", "2", "--tokens", "8192", "--depths", "1,2", "--extra", "",
                                      "--check-depth", "0", "--runs-out", str(runs), "--out", str(out),
                                      "--cards", str(tmp_path / "none.json")])
    twin_cp.main()
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"kept", "plain", "plugin"} and rows["plugin"]["llamafactory"] == lf  # plain-layers: = plain
    plain, plugin = rows["plain"], rows["plugin"]
    # k / cp = 0.5: rank 0 (10 + 15.5 + 13 + 15) / 2, rank 1 (10.5 + 15.5 + 9.5 + 15) / 2
    assert plain["ranks_gib"] == [26.75, 25.25] and plain["peak_gib_per_rank"] == 26.75
    assert plain["per_layer_gib"] == 0.5
    assert plain["from_depths_gib"] == [26.0, 28.0] and plain["measured_per_layer_gib"] == 3.0
    # the plugin: 1 / 2 + (1.5 - 1) = 1 a layer: (4 + 31 + 4.5 + 30) / 2
    assert plugin["per_layer_gib"] == 1.0
    assert plugin["peak_gib_per_rank"] == 34.75 and plugin["fits"] is True and plugin["measured_per_layer_gib"] == 0.5
    assert "measured_peak_gib_per_rank" not in plain


@pytest.mark.slow
def test_twin_launch_under_ulysses(tmp_path):
    """One twin run at cp 2 (scale 64, one layer, the plugin): both ranks report a peak, the fused CP loss engaged and
    the guard held v1's own sequence_parallel_loss against it."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "v1.py"), "--twin", "64", "--cp", "2",
                           "--layers", "1", "--cutoff", "4096", "--micro-batch", "2", "--steps", "1", "--runs", "1",
                           "--variants", "plugin-head", "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fits"] and row["cp_size"] == 2 and len(row["peak_gib_per_rank"]) == 2, row.get("error")
    assert all(p > 0 for p in row["peak_gib_per_rank"]) and row["peak_gib"] == max(row["peak_gib_per_rank"])
    assert "sharding=FSDP2" in row["engaged"] and "sequence_parallel_loss" in row["guard"], (row["engaged"],
                                                                                            row["guard"])
    log = open(row["log"]).read()
    assert "[liger_fsdp] v1 sequence parallelism (Ulysses, cp_size 2)" in log
    assert "[cpu_ulysses] rank 1 of cp 2: input_ids [2, 64] -> [2, 32]" in log
