"""DPO and KTO through real `llamafactory-cli train` runs on 2 CPU ranks (FSDP2 via the test shim, and DeepSpeed
ZeRO-3), LoRA + embed_tokens/lm_head, tiny local pairwise (`ranking: true`) and KTO datasets: per-step losses and
every logged reward/log-prob/logit metric with `liger_fsdp: true` equal the run without the flag (rel <= 1e-4,
fp32), the engaged line is there and the step-1 guard held the replaced trainer method against LLaMA-Factory's own
once (on the policy's first call)."""

import json

import pytest

from support.cli import FSDP2, base_yaml, deepspeed, run_cli

pytestmark = pytest.mark.slow
TOL = 1e-4
DPO = dict(stage="dpo", dataset="tiny_pairs", pref_beta=0.1, pref_loss="sigmoid", max_steps=3)
KTO = dict(stage="kto", dataset="tiny_kto", pref_beta=0.1, max_steps=3)


def _history(out):
    """Per step, every logged training metric (trainer_state.json's log_history)."""
    state = json.loads((out / "trainer_state.json").read_text())
    return {rec["step"]: {k: v for k, v in rec.items() if isinstance(v, float) and k not in ("learning_rate", "epoch")}
            for rec in state["log_history"] if "loss" in rec}


def _pair(assets, tmp_path, name, nproc=2, **cfg):
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"{name}_{'liger' if flag else 'plain'}"
        rc, log, _ = run_cli(base_yaml(assets, out, **({"liger_fsdp": True} if flag else {}), **cfg), nproc=nproc)
        assert rc == 0, log[-6000:]
        runs[flag] = (_history(out), log)
    (plain, _), (fused, log) = runs[False], runs[True]
    assert sorted(plain) == sorted(fused) == [1, 2, 3], (plain, fused)
    worst = {}
    for step in plain:
        assert plain[step].keys() == fused[step].keys()
        for key, ref in plain[step].items():
            # rewards are beta x (policy - reference) log-probs: their rounding is relative to beta x |log-probs|
            scale = max(abs(ref), 0.1 * max(abs(v) for k, v in plain[step].items() if "logps" in k)) if "rewards" in key else abs(ref)
            worst[key] = max(worst.get(key, 0.0), abs(fused[step][key] - ref) / max(scale, 1e-6))
    print(name, {k: f"{v:.1e}" for k, v in worst.items()})
    assert all(v <= TOL for v in worst.values()), worst
    assert "rewards/chosen" in plain[1] or "rewards/chosen_sum" in plain[1]
    guard = [l for l in log.splitlines() if "[liger_fsdp] guard:" in l]  # once, on the policy's first request
    method = {"dpo": "CustomDPOTrainer.concatenated_forward", "kto": "CustomKTOTrainer.forward"}[cfg["stage"]]
    assert len(guard) == 1 and f"guard: step 1 exact: LLaMA-Factory's {method}" in guard[0], guard  # vs the original
    return log


def test_dpo_fsdp2(assets, tmp_path):
    log = _pair(assets, tmp_path, "dpo_fsdp2", **DPO, **FSDP2)
    assert "[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=FSDP2" in log


def test_kto_fsdp2(assets, tmp_path):
    log = _pair(assets, tmp_path, "kto_fsdp2", **KTO, **FSDP2)
    assert "[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=FSDP2" in log


def test_dpo_zero3(assets, tmp_path):
    log = _pair(assets, tmp_path, "dpo_z3", **DPO, **deepspeed(tmp_path, 3))
    assert "sharding=DeepSpeed ZeRO-3" in log and "through DeepSpeed's gather hooks" in log
