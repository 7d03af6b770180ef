"""2 gloo ranks (CPU), through tests/fsdp_worker.py: a vision-language model (Qwen2-VL), MoE families
(aux loss on) and a head with a bias, under FSDP2 and FSDP1 (flat parameters), against the unsharded unfused
single-process reference (fp32, rel <= 1e-5). The step-1 guard runs on every rank (on by default) and its
all-reduced verdict must pass. The worker feeds each family its own batches (images for Qwen2-VL)."""

import pytest

from support.dist import every_rank, launch

pytestmark = pytest.mark.slow

CASES = {"fsdp2": ["qwen2_vl:mts", "qwen2_vl:lora", "qwen3_moe:mts", "mixtral:lora", "phi:mts"],
         "fsdp1_flat": ["qwen2_vl:mts", "qwen3_moe:lora", "phi:mts"]}
TOL = 1e-5


def _run(mode, tmp_path):
    out = tmp_path / f"{mode}.json"
    proc = launch("fsdp_worker.py", mode, out, *CASES[mode], timeout=900)
    return every_rank(proc, out), proc.stderr


@pytest.mark.parametrize("mode", sorted(CASES))
def test_families_sharded(mode, tmp_path):
    ranks, log = _run(mode, tmp_path)
    for results in ranks:
        for r in results:
            assert "error" not in r, r["error"]
            assert r["loss_rel"] <= TOL and r["param_rels_after"] <= TOL, r
            bad = {n: v for n, v in r["grad_rels"].items() if not v <= TOL}
            assert not bad, (r["case"], bad)
            assert r["moved"] > 1e-3
            assert r["proof"]["fsdp"] == {"fsdp2": "FSDP2", "fsdp1_flat": "FSDP1"}[mode], r["proof"]
    assert log.count("[liger_fsdp] guard: step 1 exact") == len(CASES[mode])  # rank 0 logs, every rank checks
