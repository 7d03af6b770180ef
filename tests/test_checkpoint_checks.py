"""Parse-time refusals and choices around checkpoints (in process, through LLaMA-Factory's parser):
the state-dict type of an FSDP2 adapter run, half-written checkpoints, and keys that cannot work
with the plugin."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from llamafactory_liger_fsdp.checkpoint import resume
from llamafactory_liger_fsdp.config import LigerFsdpConfigError
from support import names_key_and_fix


@pytest.fixture
def base(assets, tmp_path):
    return dict(
        model_name_or_path=str(assets / "model"), stage="sft", do_train=True, finetuning_type="lora",
        dataset="tiny_alpaca", dataset_dir=str(assets / "data"), template="llama3", output_dir=str(tmp_path / "out"),
        report_to="none", liger_fsdp=True,
    )


FSDP2 = dict(fsdp="full_shard auto_wrap", fsdp_config=dict(version=2, transformer_layer_cls_to_wrap="LlamaDecoderLayer"))


def _train_args(args):
    from llamafactory.hparams import get_train_args

    return get_train_args(args)


def _checkpoint(path, state=True, weights=True):
    """A small checkpoint directory: trainer_state.json (or not), a torch zip file, a safetensors file."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    if weights:
        torch.save({"x": torch.ones(3)}, os.path.join(path, "optimizer.bin"))
        save_file({"w": torch.ones(4, 4)}, os.path.join(path, "adapter_model.safetensors"))
    if state:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": int(str(path).rsplit("-", 1)[1])}, f)
    return str(path)


def test_fsdp2_sharded_state_dict_refused(base, monkeypatch):
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base, **FSDP2))
    names_key_and_fix(str(err.value), "fsdp_state_dict_type: SHARDED_STATE_DICT", "FULL_STATE_DICT")


@pytest.mark.parametrize("head", ["mts", "frozen"])
def test_fsdp2_adapter_checkpoints_set_at_load_whether_or_not_the_loss_engages(base, monkeypatch, capsys, head):
    """Parsing changes nothing; loading an FSDP2 adapter model picks FULL_STATE_DICT and (accelerate < 1.15) the
    checkpoint repair, also for a frozen head (the loss does not engage, the checkpoints still need both);
    disengage undoes both."""
    import accelerate
    import transformers.trainer as trainer_module

    from llamafactory_liger_fsdp import _patch, config
    from llamafactory_liger_fsdp.engage import disengage, engaged
    from llamafactory_liger_fsdp.integration.llamafactory import engage_model
    from llamafactory_liger_fsdp.testing import make_model, make_peft

    monkeypatch.delenv("FSDP_STATE_DICT_TYPE", raising=False)
    monkeypatch.setattr(accelerate, "__version__", "1.11.0")
    *_, finetuning_args, _ = _train_args(dict(base, **FSDP2))
    assert "FSDP_STATE_DICT_TYPE" not in os.environ  # no side effect at parse time
    model = make_peft(make_model("llama"), "mts")
    if head == "frozen":
        model.base_model.model.lm_head.modules_to_save.default.weight.requires_grad_(False)
    engage_model(model, config.get_config(finetuning_args), finetuning_args)
    assert (engaged(model) is not None) == (head == "mts")
    assert os.environ["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"
    assert getattr(trainer_module.save_fsdp_model, _patch.MARK, False)
    assert "[liger_fsdp] FSDP2 + adapter: using fsdp_state_dict_type FULL_STATE_DICT" in capsys.readouterr().err
    disengage(model)
    assert "FSDP_STATE_DICT_TYPE" not in os.environ and not getattr(trainer_module.save_fsdp_model, _patch.MARK, False)


def test_full_finetuning_keeps_accelerates_choice(base, monkeypatch):
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")  # sharded DCP checkpoints are right for full FT
    _train_args(dict(base, finetuning_type="full", **FSDP2))
    assert os.environ["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"


@pytest.mark.parametrize(
    "state, weights, reason",
    [
        (False, True, "no trainer_state.json (the Trainer writes it last)"),
        (True, "truncated_bin", "optimizer.bin is truncated (no zip directory)"),
        (True, "truncated_st", "adapter_model.safetensors is truncated"),
        (True, "tmp", "pytorch_model_fsdp.bin.tmp is an unfinished write"),
    ],
)
def test_incomplete_reasons(tmp_path, state, weights, reason):
    path = _checkpoint(tmp_path / "checkpoint-4", state=state)
    if weights == "truncated_bin":
        data = open(os.path.join(path, "optimizer.bin"), "rb").read()
        open(os.path.join(path, "optimizer.bin"), "wb").write(data[: len(data) // 2])
    elif weights == "truncated_st":
        data = open(os.path.join(path, "adapter_model.safetensors"), "rb").read()
        open(os.path.join(path, "adapter_model.safetensors"), "wb").write(data[:-8])
    elif weights == "tmp":
        open(os.path.join(path, "pytorch_model_fsdp.bin.tmp"), "wb").write(b"PK")
    assert resume.incomplete(path) == reason
    assert resume.incomplete(_checkpoint(tmp_path / "checkpoint-2")) is None


def test_explicit_incomplete_resume_refused(base, tmp_path):
    out = tmp_path / "out"
    good = _checkpoint(out / "checkpoint-2")
    bad = _checkpoint(out / "checkpoint-4", state=False)
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base, resume_from_checkpoint=bad))
    names_key_and_fix(str(err.value), f"resume_from_checkpoint: {bad}", "resume_from_checkpoint", good)
    assert "no trainer_state.json" in str(err.value)


def test_auto_resume_skips_incomplete(base, tmp_path, capsys):
    out = tmp_path / "out"
    _checkpoint(out / "checkpoint-2")
    good = _checkpoint(out / "checkpoint-4")
    bad = _checkpoint(out / "checkpoint-6", state=False)
    _, _, training_args, *_ = _train_args(dict(base))  # LLaMA-Factory picks checkpoint-6 by itself
    assert training_args.resume_from_checkpoint == good
    err = capsys.readouterr().err
    assert f"[liger_fsdp] resume: {bad} is incomplete (no trainer_state.json (the Trainer writes it last)); skipped" in err
    assert "resuming from" not in err  # LLaMA-Factory's own line names the checkpoint (test_e2e_checkpoints)


def test_auto_resume_with_nothing_complete_refused(base, tmp_path):
    out = tmp_path / "out"
    bad = _checkpoint(out / "checkpoint-2", state=False)
    with pytest.raises(LigerFsdpConfigError) as err:
        _train_args(dict(base))
    names_key_and_fix(str(err.value), "output_dir", "checkpoint-*", "overwrite_output_dir: true")
    assert f"({bad}: no trainer_state.json" in str(err.value)


def test_without_flag_nothing_changes(base, tmp_path):
    out = tmp_path / "out"
    _checkpoint(out / "checkpoint-2")
    bad = _checkpoint(out / "checkpoint-4", state=False)
    _, _, training_args, *_ = _train_args(dict(base, liger_fsdp=False))
    assert training_args.resume_from_checkpoint == bad  # LLaMA-Factory's own choice, untouched


@pytest.mark.parametrize("key", ["use_kt", "use_hyper_parallel", "use_mca", "use_megatron_bridge"])
def test_incompatible_backends(key):
    from llamafactory_liger_fsdp import refusals

    parsed = {"model": SimpleNamespace(use_kt=key == "use_kt"),
              "finetuning": SimpleNamespace(stage="sft", **{key: True})}
    with pytest.raises(LigerFsdpConfigError) as err:
        refusals.check_parsed(parsed)
    if key in ("use_mca", "use_megatron_bridge"):  # set by LLaMA-Factory from USE_MCA / USE_MEGATRON_BRIDGE
        names_key_and_fix(str(err.value), key, f"unset {key.upper()}", "remove `liger_fsdp`")
    else:
        names_key_and_fix(str(err.value), f"{key}: true", f"{key}: false")


@pytest.mark.parametrize("var", ["USE_MCA", "USE_MEGATRON_BRIDGE"])
def test_engines_that_never_call_load_model_refused_from_the_environment(var, monkeypatch, base):
    """LLaMA-Factory's Megatron engines are switched on by the environment alone; the raw yaml check (the launching
    process, before any rank starts) refuses them."""
    from llamafactory_liger_fsdp import config, refusals

    monkeypatch.setenv(var, "1")
    with pytest.raises(LigerFsdpConfigError) as err:
        refusals.check_raw(base, None, config.from_mapping({"liger_fsdp": True}))
    names_key_and_fix(str(err.value), var.lower(), f"unset {var}")
    assert "load_model" in str(err.value) or "own model and loss" in str(err.value)


@pytest.mark.parametrize("version, patched", [("1.11.0", True), ("1.14.0", True), ("1.15.0", False), ("1.16.2", False)])
def test_repair_only_where_accelerate_loses_adapters(monkeypatch, version, patched):
    """accelerate >= 1.15 saves FSDP2 adapters as full tensors itself: the repair stays out of its way."""
    import accelerate
    import transformers.trainer as trainer_module

    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp.config import LigerFsdpConfig
    from llamafactory_liger_fsdp.integration import trainer

    monkeypatch.setattr(accelerate, "__version__", version)
    original = trainer_module.save_fsdp_model
    try:
        trainer.patch_checkpointing(LigerFsdpConfig(enabled=True))
        assert getattr(trainer_module.save_fsdp_model, _patch.MARK, False) is patched
        assert getattr(trainer_module.load_fsdp_model, _patch.MARK, False) is patched
    finally:
        _patch.undo(trainer_module, "save_fsdp_model")
        _patch.undo(trainer_module, "load_fsdp_model")
    assert trainer_module.save_fsdp_model is original


def test_repair_switch_off(monkeypatch, capsys):
    import accelerate
    import transformers.trainer as trainer_module

    from llamafactory_liger_fsdp import _patch
    from llamafactory_liger_fsdp.config import LigerFsdpConfig
    from llamafactory_liger_fsdp.integration import trainer

    monkeypatch.setattr(accelerate, "__version__", "1.11.0")
    trainer.patch_checkpointing(LigerFsdpConfig(enabled=True, checkpoint_repair=False))
    assert not getattr(trainer_module.save_fsdp_model, _patch.MARK, False)
    assert "liger_fsdp_checkpoint_repair: false" in capsys.readouterr().err


def test_zero3_dtype_cast_only_once_engaged_and_undone(monkeypatch, capsys):
    """DeepSpeed ZeRO-3 + bf16: the trainable parameters take the compute dtype only when the plugin engages (a frozen
    head leaves the model as LLaMA-Factory built it), one line says what was cast, and disengage casts them back."""
    from types import SimpleNamespace

    from llamafactory_liger_fsdp import sharding
    from llamafactory_liger_fsdp.config import LigerFsdpConfig
    from llamafactory_liger_fsdp.engage import disengage
    from llamafactory_liger_fsdp.integration.llamafactory import engage_model
    from llamafactory_liger_fsdp.testing import make_model, make_peft

    cfg = LigerFsdpConfig(enabled=True, backend="torch", sharding=sharding.Sharding(sharding.DEEPSPEED, 3))
    args = SimpleNamespace(stage="sft", finetuning_type="lora")
    for frozen in (True, False):
        model = make_peft(make_model("llama", dtype=torch.bfloat16), "mts")  # PEFT: LoRA fp32, copies bf16
        if frozen:
            model.base_model.model.lm_head.modules_to_save.default.weight.requires_grad_(False)
        before = {n: p.dtype for n, p in model.named_parameters()}
        assert {d for n, d in before.items() if "lora_" in n} == {torch.float32}
        engage_model(model, cfg, args)
        after = {n: p.dtype for n, p in model.named_parameters()}
        err = capsys.readouterr().err
        if frozen:
            assert after == before and "compute dtype" not in err
            continue
        assert {d for n, d in after.items() if dict(model.named_parameters())[n].requires_grad} == {torch.bfloat16}
        assert "[liger_fsdp] DeepSpeed ZeRO-3: trainable parameters in the compute dtype" in err and "-> bfloat16" in err
        disengage(model)
        assert {n: p.dtype for n, p in model.named_parameters()} == before
