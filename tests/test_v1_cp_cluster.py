"""v1 sequence parallelism (Ulysses) laid out as on a cluster, on CPU gloo ranks (the stand-ins of
``llamafactory_liger_fsdp.testing.cpu_ulysses``): data parallel 2 x cp_size 2 over 4 ranks, launched as two torchrun
"nodes" of two processes on this host (global rank != local rank on the second), several v1 runs one after another
in each process through v1's Python API (tests/support/v1_runs.py). One launch holds every cluster run:

0. RM at dp 2 x cp 2, its 4 pair rows of different lengths, so the two data-parallel groups' micro-batches differ
   (v1 pads each to its own longest row) -- with the RM guard's long-context limit scaled to these rows
   (tests/support/long_rm_shim), where one group's micro-batch is over it and the other's is not: a rank that decides
   alone leaves the others in a collective it never enters (gloo aborted on a size mismatch at ea3858c; where a
   launch waits instead, it is killed at its timeout);
1. the same RM run again in the same processes: its guard must check it again;
2. SFT (LoRA + ``modules_to_save: [lm_head]``) with v1's FSDP2 ``offload_params: true``, and the CPU stand-in strict
   about devices (``CPU_ULYSSES_STRICT_DEVICES``): v1's ``sequence_parallel_loss`` moving inputs to
   ``cuda:{global rank}`` raises on the second node, where no such device exists;
3. DPO (git main only: 0.9.5's v1 has no DPO trainer), the RM rows.

Each is held against the same micro-batches at cp_size 1 (one more launch, data parallel 2 on one node: LLaMA-Factory's
own RMTrainer, the plugin for SFT and DPO, as tests/test_v1_cp.py and tests/test_v1_cp_pref.py hold those against
v1's own): per-step losses within 1e-5, the trained head within 1e-5; every run trains to its end with its guard line
exact. 2 steps a run, fp32. (The same rows on one rank group them into other micro-batches: RM's scores then differ
by ~1e-4, as LLaMA-Factory's own attention over a pair row depends on its micro-batch's padding.)
"""

import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("llamafactory.v1.trainers.rm_trainer")

from llamafactory_liger_fsdp.testing import rel  # noqa: E402
from support.cli import ROOT  # noqa: E402
from support.cluster import torchrun_nodes  # noqa: E402
from support.v1 import losses, v1_yaml, weights  # noqa: E402
from test_v1_cp import CUTOFF, SPLIT, ULYSSES, cp_keys, long_answers  # noqa: E402

LONG_RM = ROOT / "tests" / "support" / "long_rm_shim"
#: the scaled limit (tokens a micro-batch): 2 rows with the long pair are over it, 2 short ones under
LONG_TOKENS = 440
TIMEOUT = int(os.environ.get("V1_CLUSTER_TIMEOUT", "480"))  # s, a launch; honest: ~35 s on 2 cores
RM, RM_AGAIN, SFT, DPO = range(4)
GUARD = "[liger_fsdp] guard: step 1 exact: "


def has_dpo() -> bool:
    from llamafactory.v1.trainers import dpo_trainer

    return hasattr(dpo_trainer, "DPOTrainer")


def four_pairs(assets, base) -> str:
    """4 pair rows of clearly different lengths: three short answers (4, 6, 8 words) and a long one (the chosen and
    rejected texts twice): whichever data-parallel group gets the long row pads its micro-batch to it."""
    rows = json.loads((assets / "data" / "tiny_pairs.json").read_text())[:4]
    pairs = []
    for r, words in zip(rows, (4, 6, 8, None)):
        answer = {side: " ".join(r[side].split()[:words]) if words else f"{r[side]} {r[side]}"
                  for side in ("chosen", "rejected")}
        pairs.append({side: [{"role": "user", "content": r["instruction"]},
                             {"role": "assistant", "content": answer[side]}] for side in ("chosen", "rejected")})
    (base / "four_pairs.json").write_text(json.dumps(pairs))
    data = base / "four_pairs.yaml"
    data.write_text(json.dumps({"pairs": {"path": str(base / "four_pairs.json"), "source": "local",
                                          "converter": "pair"}}))
    return str(data)


def runs_at(assets, base, size: int) -> list:
    """(command, v1 args) of the runs at ``size`` (cp_size; 1: the default attention for SFT)."""
    pairs, answers, name = four_pairs(assets, base), long_answers(assets, base), f"cp{size}"
    cp = cp_keys(size) if size > 1 else {}
    flash = {"flash_attn": "flash_attention_2"}
    common = dict(global_batch_size=4, micro_batch_size=2, max_steps=2)
    rm = [v1_yaml(assets, base / f"{name}_rm{i}", "full", plugin=size > 1, train_dataset=pairs, cutoff_len=511,
                  **flash, **cp, **common) for i in range(2 if size > 1 else 1)]
    sft_cp = json.loads(json.dumps(cp))
    if size > 1:
        sft_cp["dist_config"].update(offload_params=True, pin_memory=False)  # no CUDA to pin for
    sft = v1_yaml(assets, base / f"{name}_sft", "mts", train_dataset=answers, cutoff_len=CUTOFF,
                  **(flash if size > 1 else {}), **sft_cp, **common)
    dpo = v1_yaml(assets, base / f"{name}_dpo", "mts", train_dataset=pairs, cutoff_len=511, **flash, **cp, **common)
    for cfg in (sft, dpo):
        cfg["peft_config"]["lora_dropout"] = 0.0
    found = [("rm", cfg) for cfg in rm] + [("sft", sft)]
    return found + [("dpo", dpo)] if has_dpo() else found


@pytest.fixture(scope="module")
def launches(assets, tmp_path_factory):
    """The cluster launch (2 nodes x 2 ranks) and the cp_size-1 launch (data parallel 2: each rank the same
    micro-batches as a CP group of the cluster's), each with its runs' args."""
    base = tmp_path_factory.mktemp("v1_cp_cluster")
    cluster_runs, reference_runs = runs_at(assets, base, 2), runs_at(assets, base, 1)
    reference_runs.insert(RM_AGAIN, None)  # same indices as the cluster's runs
    cluster = torchrun_nodes(cluster_runs, nnodes=2, nproc=2, timeout=TIMEOUT, shims=(LONG_RM, ULYSSES),
                             env={"CPU_ULYSSES_STRICT_DEVICES": "1", "LONG_RM_TOKENS": str(LONG_TOKENS)})
    reference = torchrun_nodes([r for r in reference_runs if r], nnodes=1, nproc=2, timeout=TIMEOUT, shims=(ULYSSES,))
    if os.environ.get("V1_CLUSTER_LOG"):  # for reading a failure whole
        Path(os.environ["V1_CLUSTER_LOG"]).write_text(cluster.log + "\n==== cp_size 1 ====\n" + reference.log)
    print(f"\n[test_v1_cp_cluster] cluster launch {cluster.seconds:.0f} s, cp_size-1 launch {reference.seconds:.0f} s")
    return cluster, cluster_runs, reference, reference_runs


def finished(launch, i: int) -> str:
    """Run ``i``'s lines, once it trained to its end."""
    if not launch.done(i):
        what = "killed at its timeout" if launch.timed_out else f"exited {launch.rc}"
        pytest.fail(f"run {i} did not finish (the launch {what}); first errors:\n{launch.first_errors()}\n"
                    f"...\n{launch.log[-6000:]}")
    return launch.run_log(i)


def same_training(launches, i: int, head: str) -> str:
    """Run ``i`` of the cluster launch against the same rows at cp_size 1: losses and the trained head."""
    cluster, cluster_runs, reference, reference_runs = launches
    ref_i = i if i != RM_AGAIN else RM
    log = finished(cluster, i)
    finished(reference, [r for r in reference_runs if r].index(reference_runs[ref_i]))
    out, ref_out = cluster_runs[i][1]["output_dir"], reference_runs[ref_i][1]["output_dir"]
    got, ref = losses(out), losses(ref_out)
    assert len(ref) == 2 and all(rel(a, b) < 1e-5 for a, b in zip(got, ref)), (got, ref)
    got_w, ref_w = weights(out), weights(ref_out)
    heads = [k for k in ref_w if head in k]
    assert heads and got_w.keys() == ref_w.keys(), (sorted(got_w), sorted(ref_w))
    assert all(rel(got_w[k], ref_w[k]) < 1e-5 for k in heads), [(k, rel(got_w[k], ref_w[k])) for k in heads]
    return log


def first_lengths(log: str) -> dict:
    """Global rank -> the padded length of its first micro-batch split (the guard's and the step's are the same)."""
    found = {}
    for hit in re.finditer(SPLIT.pattern + r" \(global rank (\d+)\)", log):
        found.setdefault(int(hit.group(8)), int(hit.group(4)))
    return found


@pytest.mark.slow
def test_rm_at_dp2_cp2_with_different_lengths_trains_as_at_cp1(launches):
    log = same_training(launches, RM, "score.weight")
    assert re.search(re.escape(GUARD) + r".*RMTrainer\.compute_loss", log), log[-6000:]
    lengths = first_lengths(log)
    assert sorted(lengths) == [0, 1, 2, 3] and lengths[0] == lengths[1] and lengths[2] == lengths[3], lengths
    tokens = sorted(2 * lengths[r] for r in (0, 2))  # 2 rows a micro-batch; one group over the scaled limit
    assert tokens[0] <= LONG_TOKENS < tokens[1], (tokens, LONG_TOKENS)


@pytest.mark.slow
def test_dpo_at_dp2_cp2_with_different_lengths_trains_as_at_cp1(launches):
    if not has_dpo():
        pytest.skip("this LLaMA-Factory's v1 has no DPO trainer (0.9.5); git main's stack runs it")
    log = same_training(launches, DPO, "lm_head")
    assert re.search(re.escape(GUARD) + r".*DPOTrainer\.compute_loss", log), log[-6000:]
    lengths = first_lengths(log)
    assert sorted(lengths) == [0, 1, 2, 3] and lengths[0] != lengths[2], lengths


@pytest.mark.slow
def test_sft_on_two_nodes_trains_as_at_cp1(launches):
    """Two torchrun processes (``--nnodes 2``), two ranks each: on the second, RANK 2 and 3 are LOCAL_RANK 0 and 1,
    and the strict CPU stand-in fails any device addressed by the global rank."""
    log = same_training(launches, SFT, "lm_head")
    assert re.search(re.escape(GUARD) + r".*sequence_parallel_loss", log), log[-6000:]
    assert "[liger_fsdp] v1 sequence parallelism (Ulysses, cp_size 2)" in launches[0].log
    started = set(re.findall(r"\[v1_runs\] run 2 sft start \(RANK (\d), LOCAL_RANK (\d)\)", log))
    assert started == {("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")}, started
    assert set(first_lengths(log)) == {0, 1, 2, 3}  # every rank split its micro-batches


@pytest.mark.slow
def test_offload_params_under_cp_trains_with_the_guard(launches):
    log = finished(launches[0], SFT)
    told = re.findall(r"\[v1_runs\] run 2 rank (\d): FSDP2 units (\d+), CPU-offloaded (\d+)", log)
    assert sorted(int(r) for r, *_ in told) == [0, 1, 2, 3], log[-6000:]
    assert all(int(units) > 1 and offloaded == units for _, units, offloaded in told), told  # CPUOffloadPolicy
    assert GUARD in log, log[-6000:]


@pytest.mark.slow
def test_a_second_run_in_one_process_is_checked_again(launches):
    """The same RM run twice in the same processes: the second has its own guard line and trains as the first."""
    first, again = finished(launches[0], RM), same_training(launches, RM_AGAIN, "score.weight")
    for log in (first, again):
        assert len(re.findall(re.escape(GUARD) + r".*RMTrainer\.compute_loss", log)) == 1, log[-6000:]
    cluster_runs = launches[1]
    assert losses(cluster_runs[RM][1]["output_dir"]) == losses(cluster_runs[RM_AGAIN][1]["output_dir"])


def test_strict_cpu_stand_in_refuses_a_device_by_the_global_rank(monkeypatch):
    """The stand-in that makes the two-node test fail where a cluster would: cuda:{global rank} on a second node."""
    import torch

    from llamafactory_liger_fsdp.testing import cpu_ulysses

    dist = cpu_ulysses._CpuRankDist()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert dist.get_rank() == torch.device("cpu")  # not strict: the CPU, as on one node
    monkeypatch.setenv(cpu_ulysses.STRICT, "1")
    with pytest.raises(RuntimeError, match=r"addresses device cuda:2 by the global rank; this process is local rank 0"):
        dist.get_rank()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.get_rank() == torch.device("cpu")  # the first node: the global rank is the local one
