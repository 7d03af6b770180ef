"""What the plugin takes and refuses of v1's preference trainers under sequence parallelism, decided from the yaml
(fast tier): RM at cp_size > 1 is taken (the scores gathered across the CP group, :mod:`.integration.v1.cp_rm`), RM
at cp_size 1 stays refused (a one-logit score head: nothing to fuse), DPO under CP is taken (:mod:`.cp_dpo`), the
other CP refusals hold for both, and an RM run is not held to the micro-batch-1 refusal of 0.9.5's SFT positions."""

import pytest

from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from llamafactory_liger_fsdp.integration.v1 import args as v1_args
from llamafactory_liger_fsdp.integration.v1 import cp_args as v1_cp_args

BASE = {"kernel_config": {"name": "liger_fsdp"}, "micro_batch_size": 2, "flash_attn": "flash_attention_2"}
CP = [v1_cp_args.as_yaml(2)]  # as the installed v1 spells it (the other spelling is refused: test_cp_yamls_*)


@pytest.mark.parametrize("values", CP)
def test_rm_under_cp_is_taken(values):
    v1_args.check("rm", {**BASE, **values})
    v1_args.check(None, {**BASE, **values, "model_class": "cls"})


@pytest.mark.parametrize("command, values", [("rm", {}), (None, {"model_class": "cls"})])
def test_rm_at_cp_1_stays_refused(command, values):
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.check(command, {**BASE, **values})
    msg = str(err.value)
    assert "one-logit score head, so there is nothing to fuse" in msg and "Fix: remove `liger_fsdp` from " \
        "`kernel_config.name` for reward modelling (with `cp_size` > 1 the plugin gathers the scores" in msg, msg


@pytest.mark.parametrize("values", CP)
def test_dpo_under_cp_is_taken(values, monkeypatch):
    monkeypatch.setattr(v1_cp_args, "has_v1_dpo", lambda: True)  # git main (0.9.5 has none: test_cp_yamls_*)
    v1_args.check("dpo", {**BASE, **values})


@pytest.mark.parametrize("values, expected", [
    (v1_cp_args.as_yaml(2, dist_name="deepspeed"), "`dist_config.name: deepspeed`"),
    (v1_cp_args.as_yaml(2, "ring"), "cp_mode: ring`"),
])
@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_pairs_under_cp_keep_the_cp_refusals(values, expected, command, monkeypatch):
    monkeypatch.setattr(v1_cp_args, "has_v1_dpo", lambda: True)
    with pytest.raises(LigerFsdpConfigError) as err:
        v1_args.check(command, {**BASE, **values})
    assert expected in str(err.value) and "Fix:" in str(err.value), str(err.value)


def test_rm_not_held_to_the_micro_batch_1_refusal(monkeypatch):
    """0.9.5's SFT positions start at 1 (a pad of position 0 looks packed); RMTrainer numbers its own from 0."""
    real = v1_cp_args.versions.installed
    monkeypatch.setattr(v1_cp_args.versions, "installed",
                        lambda name: "0.9.5" if name == "llamafactory" else real(name))
    monkeypatch.setattr(v1_cp_args, "spelling", lambda: v1_cp_args.DIST)  # as 0.9.5 reads them
    values = {**BASE, "micro_batch_size": 1, "dist_config": {"name": "fsdp2", "cp_size": 2}}
    with pytest.raises(LigerFsdpConfigError, match=r"`micro_batch_size: 1` with `dist_config.cp_size: 2`"):
        v1_args.check("sft", values)
    v1_args.check("rm", values)


def test_doctor_line_names_rm_and_dpo(monkeypatch):
    line = v1_cp_args.doctor_line({**BASE, **CP[0]})
    assert "`llamafactory-cli rm`: the score head's scores of each shard gathered across the CP group" in line, line
    monkeypatch.setattr(v1_cp_args, "has_v1_dpo", lambda: True)
    line = v1_cp_args.doctor_line({**BASE, **CP[0]})
    assert "`llamafactory-cli dpo`: the policy's and the reference's per-token log-probs" in line, line
    monkeypatch.setattr(v1_cp_args, "has_v1_dpo", lambda: False)
    assert "`llamafactory-cli dpo`: not in the installed LLaMA-Factory" in v1_cp_args.doctor_line({**BASE, **CP[0]})
