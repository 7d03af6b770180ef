"""LLaMA-Factory v1's Ulysses sequence parallelism with the plugin, on CPU ranks (the flash-attention and gloo
stand-ins of ``llamafactory_liger_fsdp.testing.cpu_ulysses``; the all-to-all, padding and split are v1's own).

v1 SFT, LoRA + ``modules_to_save: [lm_head]``, FSDP2, fp32, ``lora_dropout: 0``, ``cutoff_len: 127`` (v1 pads every
row to a multiple of cp_size), 4 rows a step: cp_size 2 (2 ranks, 2 micro-batches a step) and cp_size 4 (4 ranks)
with the plugin against cp_size 1 with the plugin (one rank; data parallel x CP: test_v1_cp_cluster.py), cp_size 2 against v1's own CP
loss (logits), and a LoRA head at cp_size 2 against cp_size 1: per-step losses, the saved head and the saved adapter
as a whole within 1e-5, each adapter tensor within 1e-4 (after three AdamW steps one LoRA tensor reached 1.3e-5
between v1's own cp 2 and cp 1 runs on git main's stack). Each run also shows that every rank received its part of
every sequence, that labelled targets crossed the shard boundaries, and (the plugin's) that the head was computed
through its own FSDP units and the guard held v1's own CP loss against it; a 1% error injected into the plugin's CP
loss is stopped at step 1. The refusals of what stays out of reach are in the fast tier.
"""

import dataclasses
import json
import re
import shutil

import pytest
import torch

pytest.importorskip("llamafactory.v1")

from llamafactory_liger_fsdp.integration.v1 import args as v1_args  # noqa: E402
from llamafactory_liger_fsdp.integration.v1 import cp_args as v1_cp_args  # noqa: E402
from llamafactory_liger_fsdp.config import LigerFsdpConfigError  # noqa: E402
from llamafactory_liger_fsdp.testing import rel  # noqa: E402
from support.cli import ROOT  # noqa: E402
from support.v1 import losses, run_v1, v1_yaml, weights  # noqa: E402

ULYSSES = ROOT / "llamafactory_liger_fsdp" / "testing" / "cpu_ulysses_shim"
INJECT = ROOT / "tests" / "cp_inject"
CUTOFF = 127  # odd: v1 pads every row to 128 for cp 2
SPLIT = re.compile(r"\[cpu_ulysses\] rank (\d+) of cp (\d+): input_ids \[(\d+), (\d+)\] -> \[(\d+), (\d+)\], "
                   r"labelled targets across shard boundaries: (\d+)")


def cp_keys(size: int) -> dict:
    """The CP keys as the installed v1 spells them: git main's top-level ``cp_size`` / ``cp_mode``, else 0.9.5's
    ``dist_config``."""
    from llamafactory.v1.config.training_args import TrainingArguments

    if "cp_size" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return {"dist_config": {"name": "fsdp2"}, "cp_size": size, "cp_mode": "ulysses"}
    return {"dist_config": {"name": "fsdp2", "cp_size": size, "cp_mode": "ulysses"}}


def long_answers(assets, base) -> str:
    """The tiny alpaca rows with a short prompt and a long answer, so labelled targets cross the shard boundary."""
    rows = json.loads((assets / "data" / "tiny_alpaca.json").read_text())
    rows = [{"instruction": f"Question {i}?", "input": "", "output": " ".join([r["instruction"], r["output"]] * 3)}
            for i, r in enumerate(rows)]  # every row cut at CUTOFF; the prompt ends before the middle on both stacks
    (base / "long_answers.json").write_text(json.dumps(rows))
    data = base / "long_answers.yaml"
    data.write_text(json.dumps({"tiny": {"path": str(base / "long_answers.json"), "source": "local",
                                         "converter": "alpaca"}}))
    return str(data)


def cp_yaml(assets, out, data, size: int, plugin: bool = True, head: str = "mts", **overrides) -> dict:
    """A v1 SFT yaml at ``cp_size: size`` (1: no CP keys, the default attention)."""
    extra = dict(cp_keys(size), flash_attn="flash_attention_2") if size > 1 else {}
    cfg = v1_yaml(assets, out, head, plugin=plugin, cutoff_len=CUTOFF, train_dataset=data, **extra, **overrides)
    cfg["peft_config"]["lora_dropout"] = 0.0
    return cfg


def four_kv_heads(assets, base) -> str:
    """The tiny model with 4 key-value heads (v1's Ulysses splits them across up to 4 CP ranks), its own weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = base / "model_kv4"
    shutil.copytree(assets / "model", model)
    config = AutoConfig.from_pretrained(model)
    config.num_key_value_heads = 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    return str(model)


#: name -> (ranks, cp_size, plugin, head): one reference per head for every layout (global batch 4 rows a step, every
#: row cut to CUTOFF, so each step trains the same rows on 1 rank in 2 micro-batches or on 2 data-parallel ranks)
RUNS = {"cp1_plugin": (1, 1, True, "mts"), "cp2_plugin": (2, 2, True, "mts"), "cp2_v1": (2, 2, False, "mts"),
        "cp4_plugin": (4, 4, True, "mts"),
        "cp1_lora_head": (1, 1, True, "lora"), "cp2_lora_head": (2, 2, True, "lora")}
HEAD_UNITS = {"mts": "through 1 FSDP unit(s) (lm_head.modules_to_save.default)",
              "lora": "through 2 FSDP unit(s) (lm_head.base_layer, lm_head.lora_B.default)"}


class Runs(dict):
    """The launches shared by the tests (:data:`RUNS`), each made when a test first asks for it: a selection of the
    tests (scripts/test_stacks.sh on git main) launches only what it reads."""

    def __init__(self, assets, base):
        super().__init__()
        self.assets, self.base = assets, base
        self.data, self.model = long_answers(assets, base), four_kv_heads(assets, base)

    def __missing__(self, name):
        ranks, size, plugin, head = RUNS[name]
        out = self.base / name
        cfg = cp_yaml(self.assets, out, self.data, size, plugin, head, model=self.model, global_batch_size=4)
        rc, log = run_v1(cfg, nproc=ranks, shims=(ULYSSES,))
        assert rc == 0, log[-6000:]
        self[name] = (log, losses(out), weights(out))
        return self[name]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    return Runs(assets, tmp_path_factory.mktemp("v1_cp"))


@pytest.mark.slow
@pytest.mark.parametrize("run, reference", [("cp2_plugin", "cp1_plugin"), ("cp2_plugin", "cp2_v1"),
                                            ("cp4_plugin", "cp1_plugin"),
                                            ("cp2_lora_head", "cp1_lora_head")])
def test_fused_cp_loss_trains_as_reference(runs, run, reference):
    log, fused_losses, fused_w = runs[run]
    _, ref_losses, ref_w = runs[reference]
    assert len(ref_losses) == 3 and all(rel(a, b) < 1e-5 for a, b in zip(fused_losses, ref_losses)), \
        (fused_losses, ref_losses)
    heads = [k for k in ref_w if "lm_head" in k]  # the trained head (its copy or its LoRA), in the adapter
    assert heads and fused_w.keys() == ref_w.keys() and all(rel(fused_w[k], ref_w[k]) < 1e-5 for k in heads)
    names = sorted(ref_w)
    assert rel(torch.cat([fused_w[k].flatten() for k in names]), torch.cat([ref_w[k].flatten() for k in names])) < 1e-5
    for name in names:  # AdamW divides each element by its own running norm: see test_v1_dist.py
        assert rel(fused_w[name], ref_w[name]) < 1e-4, name
    size, head_kind = RUNS[run][1], RUNS[run][3]
    assert f"[liger_fsdp] v1 sequence parallelism (Ulysses, cp_size {size})" in log, log[-6000:]
    assert "outside the trainer's log-probs call" not in log  # no training forward built the [N/cp, V] logits
    assert "[liger_fsdp] guard: step 1 exact: LLaMA-Factory's sequence_parallel_loss" in log, log[-6000:]
    assert log.count("[liger_fsdp] engaged:") == 1 and "sharding=FSDP2" in log, log[-6000:]
    assert HEAD_UNITS[head_kind] in log, log[-6000:]
    assert "[liger_fsdp] engaged:" not in runs["cp2_v1"][0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp2_plugin", "cp2_v1", "cp4_plugin"])
def test_each_rank_received_its_part_of_every_sequence(runs, name):
    log, size = runs[name][0], RUNS[name][1]
    seen = SPLIT.findall(log)
    assert seen and len(seen) == log.count("[cpu_ulysses]"), log[-6000:]
    for rank, cp, b, t, b_local, t_local, _ in seen:
        assert int(cp) == size and b == b_local and int(t_local) == -(-int(t) // size), (rank, t, t_local)
    assert {int(rank) for rank, *_ in seen} == set(range(size))
    assert any(t == str(CUTOFF) for _, _, _, t, *_ in seen)  # padded by v1 to a multiple of cp_size
    assert sum(int(n) for *_, n in seen) > 0  # a shard's last position predicted the next shard's first label


@pytest.mark.slow
def test_guard_stops_a_one_percent_error_in_the_cp_loss(assets, tmp_path):
    """tests/cp_inject/sitecustomize.py multiplies the plugin's CP loss by 1.01 in every rank: step 1 stops on every
    rank with both numbers, the key and the fix."""
    out = tmp_path / "inject"
    rc, log = run_v1(cp_yaml(assets, out, long_answers(assets, tmp_path), 2), shims=(INJECT, ULYSSES))
    assert rc != 0 and "[cp_inject] the plugin's CP loss x 1.01" in log, log[-6000:]
    found = re.findall(r"`liger_fsdp_guard`: on step 1 the plugin's replacement of LLaMA-Factory's "
                       r"sequence_parallel_loss does not give what LLaMA-Factory's own gives .*?rank (\d): "
                       r"LLaMA-Factory's sequence_parallel_loss: loss ([\d.]+), with the fused kernel ([\d.]+)", log)
    assert {r for r, *_ in found} == {"0", "1"}, log[-6000:]
    assert all(abs(float(f) / float(a) - 1.01) < 1e-4 for _, a, f in found), found
    assert "(`liger_fsdp_guard: false` skips the check)" in log and "trainer_log.jsonl" not in {p.name for p in
                                                                                              out.iterdir()}


# --------------------------------------------------------------------------- what stays refused (fast tier)
BASE = {"kernel_config": {"name": "liger_fsdp"}, "micro_batch_size": 2}


FLASH = {"flash_attn": "flash_attention_2"}


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_sft_under_fsdp2_is_taken(size):
    v1_args.check("sft", {**BASE, **cp_keys(size), **FLASH})


def _spelled(values: dict) -> dict:
    """``values`` written as 0.9.5 writes them (``dist_config.cp_*``) moved to the installed v1's spelling."""
    from llamafactory_liger_fsdp.integration.v1 import cp_args

    if cp_args.spelling() == cp_args.DIST:
        return values
    dist = dict(values["dist_config"])
    return {**values, "dist_config": {"name": dist.pop("name", None)}, **dist}


@pytest.mark.parametrize("command, values, expected", [
    ("sft", {"dist_config": {"name": "fsdp2", "cp_size": 2, "cp_mode": "ring"}, **FLASH}, "cp_mode: ring`"),
    ("sft", {"dist_config": {"name": "deepspeed", "cp_size": 2}, **FLASH}, "`dist_config.name: deepspeed`"),
    ("sft", {"dist_config": {"cp_size": 2}, **FLASH}, "cp_size: 2` with `dist_config.name: None`"),
    ("sft", {"dist_config": {"name": "fsdp2", "cp_size": 2}}, "cp_size: 2` with `flash_attn: sdpa`"),
])
def test_cp_out_of_reach_refused(command, values, expected):
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.check(command, {**BASE, **_spelled(values)})
    assert expected in str(err.value) and "Fix:" in str(err.value), str(err.value)


def test_micro_batch_1_refused_where_v1_numbers_positions_from_1(monkeypatch):
    values = {**BASE, "micro_batch_size": 1, "dist_config": {"name": "fsdp2", "cp_size": 2}, **FLASH}
    monkeypatch.setattr(v1_cp_args, "spelling", lambda: v1_cp_args.DIST)  # as 0.9.5 reads them
    real = v1_cp_args.versions.installed
    monkeypatch.setattr(v1_cp_args.versions, "installed",
                        lambda name: "0.9.5" if name == "llamafactory" else real(name))
    with pytest.raises(LigerFsdpConfigError, match=r"`micro_batch_size: 1` with `dist_config.cp_size: 2` on "
                                                   r"LLaMA-Factory 0.9.5.*Fix: `micro_batch_size: 2`"):
        v1_args.check("sft", values)
    values.pop("micro_batch_size")  # v1's default is 1
    with pytest.raises(LigerFsdpConfigError, match=r"`micro_batch_size: 1` \(v1's default\) with"):
        v1_args.check("sft", values)
    monkeypatch.setattr(v1_cp_args.versions, "installed",
                        lambda name: "0.9.6.dev0" if name == "llamafactory" else real(name))
    v1_args.check("sft", values)


def test_doctor_names_the_sequence_parallel_loss(assets, monkeypatch, capsys):
    from llamafactory_liger_fsdp import doctor

    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    recipe = str(ROOT / "recipes" / "tiny_cpu" / "v1_sft.yaml")
    keys = [f"{k}={v}" for k, v in cp_keys(2).items() if k != "dist_config"] or ["dist_config.cp_size=2"]
    assert doctor.main(["doctor", recipe, f"model={assets / 'model'}", *keys, "flash_attn=flash_attention_2"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallelism: Ulysses, cp_size 2 (`" in out and "v1's sequence_parallel_loss from the fused " \
        "kernel" in out, out
