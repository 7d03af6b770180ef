"""LLaMA-Factory v1's reward-model and DPO trainers under Ulysses sequence parallelism with the plugin, on CPU ranks (the
flash-attention and gloo stand-ins of ``llamafactory_liger_fsdp.testing.cpu_ulysses``; the all-to-all, padding and
split are v1's own).

``llamafactory-cli rm``, full fine-tuning (LLaMA-Factory 0.9.5's v1 cannot put LoRA on its score-head model), FSDP2,
fp32, ``flash_attn: flash_attention_2`` on both sides, 4 pair rows a step: cp_size 2 with the plugin (2 ranks, 2
micro-batches a step) against LLaMA-Factory's own RMTrainer at cp_size 1 (one rank, which the plugin leaves alone),
with 2 rows a micro-batch (causal attention over each row) and with 1 (flash-attention's varlen segments from the
positions, which restart at the rejected part): per-step losses and the trained score head within 1e-5, the whole
model within 1e-5 and each tensor within 1e-4 (AdamW, as in test_v1_cp.py), except the score's bias, whose gradient
is zero. Each CP run shows that every rank
received half of every pair row, that the model was sharded over both ranks, and that the guard held
``RMTrainer.compute_loss`` on the same split forward's scores against the plugin's loss; a 1% error injected into
that loss is stopped at step 1 on every rank.

DPO (git main only; 0.9.5's v1 has no DPO trainer): sigmoid (LoRA as the reference) and ORPO with LD-DPO and
``pref_ftx``, LoRA + ``modules_to_save: [lm_head]``, 2 rows a micro-batch: cp_size 2 with the plugin against cp_size 1 with the plugin (itself held against
LLaMA-Factory's own at cp_size 1 by test_v1_dist.py): losses, the trained head and the adapter within 1e-5 (each
tensor within 1e-4), split as above, the guard holding LLaMA-Factory's own DPOTrainer.compute_loss on the same
split forward against the CP loss; a 1% error injected into the CP log-probs is stopped at step 1 on every rank.
"""

import re

import pytest

pytest.importorskip("llamafactory.v1.trainers.rm_trainer")

from llamafactory_liger_fsdp.testing import rel  # noqa: E402
from support.cli import ROOT  # noqa: E402
from support.v1 import losses, run_v1, v1_pairs, v1_yaml, weights  # noqa: E402
from test_v1_cp import SPLIT, ULYSSES, cp_keys  # noqa: E402

INJECT = ROOT / "tests" / "cp_rm_inject"
INJECT_DPO = ROOT / "tests" / "cp_dpo_inject"
#: name -> (ranks / cp_size, plugin, micro_batch_size)
RUNS = {"rm_cp1": (1, False, 2), "rm_cp2": (2, True, 2), "rm_mb1_cp1": (1, False, 1), "rm_mb1_cp2": (2, True, 1)}


def rm_yaml(assets, out, size: int, plugin: bool, micro: int) -> dict:
    extra = cp_keys(size) if size > 1 else {}
    return v1_yaml(assets, out, "full", plugin=plugin, train_dataset=str(v1_pairs(assets, out)), cutoff_len=255,
                   global_batch_size=4, micro_batch_size=micro, flash_attn="flash_attention_2", **extra)


@pytest.fixture(scope="module")
def rm_runs(assets, tmp_path_factory):
    base, found = tmp_path_factory.mktemp("v1_cp_rm"), {}
    for name, (size, plugin, micro) in RUNS.items():
        out = base / name
        rc, log = run_v1(rm_yaml(assets, out, size, plugin, micro), nproc=size, command="rm", shims=(ULYSSES,))
        assert rc == 0, log[-6000:]
        found[name] = (log, losses(out), weights(out))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("run, reference", [("rm_cp2", "rm_cp1"), ("rm_mb1_cp2", "rm_mb1_cp1")])
def test_rm_at_cp2_trains_as_llamafactorys_own_at_cp1(rm_runs, run, reference):
    log, got_losses, got = rm_runs[run]
    ref_log, ref_losses, ref = rm_runs[reference]
    assert len(ref_losses) == 3 and all(rel(a, b) < 1e-5 for a, b in zip(got_losses, ref_losses)), \
        (got_losses, ref_losses)
    assert got.keys() == ref.keys() and rel(got["score.weight"], ref["score.weight"]) < 1e-5
    # score.bias cancels in chosen - rejected: its true gradient is 0, and AdamW turns either run's rounding noise
    # into steps of the learning rate's size, of either sign (seen: 8e-4 apart on git main's stack)
    names = sorted(k for k in ref if k != "score.bias")
    assert rel(torch_cat(got, names), torch_cat(ref, names)) < 1e-5
    assert all(rel(got[k], ref[k]) < 1e-4 for k in names), [(k, rel(got[k], ref[k])) for k in names]
    assert "[liger_fsdp] v1 reward modelling under sequence parallelism (Ulysses, cp_size 2)" in log, log[-6000:]
    assert "[liger_fsdp] guard: step 1 exact: LLaMA-Factory's RMTrainer.compute_loss: " in log, log[-6000:]
    assert "mp_shard=2" in log  # v1's FSDP2 mesh over both ranks
    assert "[liger_fsdp]" not in ref_log and "[cpu_ulysses]" not in ref_log  # LLaMA-Factory's own, unsplit
    seen = SPLIT.findall(log)
    assert seen and len(seen) == log.count("[cpu_ulysses]"), log[-6000:]
    for _, cp, b, t, b_local, t_local, _ in seen:  # every rank received half of every pair row
        assert cp == "2" and b == b_local == str(RUNS[run][2]) and int(t_local) == -(-int(t) // 2), (t, t_local)
    assert {rank for rank, *_ in seen} == {"0", "1"}


def torch_cat(tensors: dict, names: list):
    import torch

    return torch.cat([tensors[k].flatten() for k in names])


@pytest.mark.slow
def test_guard_stops_a_one_percent_error_in_the_cp_rm_loss(assets, tmp_path):
    """tests/cp_rm_inject/sitecustomize.py multiplies the plugin's CP RM loss by 1.01 in every rank: step 1 stops on
    every rank with both numbers, the key and the fix."""
    out = tmp_path / "inject"
    rc, log = run_v1(rm_yaml(assets, out, 2, True, 2), command="rm", shims=(INJECT, ULYSSES))
    assert rc != 0 and "[cp_rm_inject] the plugin's CP RM loss x 1.01" in log, log[-6000:]
    found = re.findall(r"`liger_fsdp_guard`: on step 1 the plugin's replacement of LLaMA-Factory's "
                       r"RMTrainer.compute_loss does not give what LLaMA-Factory's own gives .*?, rank (\d): "
                       r"LLaMA-Factory's RMTrainer.compute_loss: loss ([\d.]+), with the scores the plugin gathered "
                       r"([\d.]+)", log)
    assert {r for r, *_ in found} == {"0", "1"}, log[-6000:]
    assert all(abs(float(f) / float(a) - 1.01) < 1e-4 for _, a, f in found), found
    assert "Fix: set `cp_size: 1`" in log and "(`liger_fsdp_guard: false` skips the check)" in log
    assert "trainer_log.jsonl" not in {p.name for p in out.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("pref", [{}, {"pref_loss": "orpo", "ld_alpha": 0.5, "pref_ftx": 0.1}])
def test_dpo_at_cp2_trains_as_at_cp1(assets, tmp_path, pref):
    from llamafactory.v1.trainers import dpo_trainer

    if not hasattr(dpo_trainer, "DPOTrainer"):
        pytest.skip("this LLaMA-Factory's v1 has no DPO trainer")
    found = {}
    for size in (1, 2):
        out = tmp_path / f"dpo_cp{size}"
        cfg = v1_yaml(assets, out, "mts", train_dataset=str(v1_pairs(assets, out)), cutoff_len=255,
                      global_batch_size=4, flash_attn="flash_attention_2", **(cp_keys(size) if size > 1 else {}),
                      **pref)
        cfg["peft_config"]["lora_dropout"] = 0.0
        rc, log = run_v1(cfg, nproc=size, command="dpo", shims=(ULYSSES,))
        assert rc == 0, log[-6000:]
        found[size] = (log, losses(out), weights(out))
    (log, got_losses, got), (_, ref_losses, ref) = found[2], found[1]
    assert len(ref_losses) == 3 and all(rel(a, b) < 1e-5 for a, b in zip(got_losses, ref_losses)), \
        (got_losses, ref_losses)
    names = sorted(ref)
    heads = [k for k in names if "lm_head" in k]
    assert heads and got.keys() == ref.keys() and all(rel(got[k], ref[k]) < 1e-5 for k in heads)
    assert rel(torch_cat(got, names), torch_cat(ref, names)) < 1e-5
    assert all(rel(got[k], ref[k]) < 1e-4 for k in names), [(k, rel(got[k], ref[k])) for k in names]
    assert "[liger_fsdp] v1 DPO under sequence parallelism (Ulysses, cp_size 2)" in log, log[-6000:]
    assert "[liger_fsdp] guard: step 1 exact: LLaMA-Factory's DPOTrainer.compute_loss: " in log, log[-6000:]
    assert "mp_shard=2" in log and "outside the trainer's log-probs call" not in log
    seen = SPLIT.findall(log)
    assert seen and {rank for rank, *_ in seen} == {"0", "1"}, log[-6000:]
    assert all(cp == "2" and b == b_local and int(t_local) == -(-int(t) // 2) for _, cp, b, t, b_local, t_local, _ in
               seen), seen
    assert sum(int(n) for *_, n in seen) > 0  # labelled targets crossed the shard boundary


@pytest.mark.slow
def test_guard_stops_a_one_percent_error_in_the_cp_dpo_logps(assets, tmp_path):
    """tests/cp_dpo_inject/sitecustomize.py multiplies the CP per-token log-probs by 1.01 in every rank."""
    from llamafactory.v1.trainers import dpo_trainer

    if not hasattr(dpo_trainer, "DPOTrainer"):
        pytest.skip("this LLaMA-Factory's v1 has no DPO trainer")
    out = tmp_path / "inject"
    cfg = v1_yaml(assets, out, "mts", train_dataset=str(v1_pairs(assets, out)), cutoff_len=255, global_batch_size=4,
                  flash_attn="flash_attention_2", **cp_keys(2))
    rc, log = run_v1(cfg, command="dpo", shims=(INJECT_DPO, ULYSSES))
    assert rc != 0 and "[cp_dpo_inject] the plugin's CP DPO log-probs x 1.01" in log, log[-6000:]
    found = re.findall(r"`liger_fsdp_guard`: on step 1 the plugin's replacement of LLaMA-Factory's "
                       r"DPOTrainer.compute_loss does not give what LLaMA-Factory's own gives .*?rank "
                       r"(\d): LLaMA-Factory's DPOTrainer.compute_loss: logps/(?:chosen|rejected) "
                       r"(-?[\d.]+), with the fused kernel (-?[\d.]+)", log)
    assert {r for r, *_ in found} == {"0", "1"}, log[-6000:]
    assert all(abs(float(f) / float(a) - 1.01) < 1e-4 for _, a, f in found), found
    assert "(`liger_fsdp_guard: false` skips the check)" in log
    assert "trainer_log.jsonl" not in {p.name for p in out.iterdir()}
