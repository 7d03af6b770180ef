"""LLaMA-Factory's v1 engine end to end: ``USE_V1=1 llamafactory-cli sft`` on 2 gloo ranks, with and without
``kernel_config: {name: liger_fsdp}``. Per-step losses equal v1's own run (fp32, 1e-5) and so do the saved weights
after three AdamW steps (1e-4: AdamW divides each gradient element by its own running norm, so the fp32 summation-order
difference of a near-zero gradient element reaches the weight at ~1e-5; the gradients themselves are compared at 1e-5
in ``test_v1.py``); the head is computed through units of its own (v1's FSDP2 engine really sharded it) and the guard
checked step 1."""

from importlib.metadata import version

import pytest

pytest.importorskip("llamafactory.v1")

from llamafactory_liger_fsdp.testing import rel  # noqa: E402
from support.v1 import losses, run_v1, v1_pairs, v1_yaml, weights  # noqa: E402

pytestmark = pytest.mark.slow

UNITS = {  # the engaged line's units per head kind under FSDP2
    "mts": "through 1 FSDP unit(s) (lm_head.modules_to_save.default)",
    "lora": "through 2 FSDP unit(s) (lm_head.base_layer, lm_head.lora_B.default)",  # A h: lora_A's own call
    "full": "through 1 FSDP unit(s) (lm_head)",
}


def _run(assets, out, head, plugin, command="sft", **overrides):
    if command == "dpo":
        overrides["train_dataset"] = str(v1_pairs(assets, out))
    rc, log = run_v1(v1_yaml(assets, out, head, plugin=plugin, **overrides), command=command)
    assert rc == 0, log[-6000:]
    return log, losses(out), weights(out)


@pytest.fixture(scope="module")
def plain_ddp(assets, tmp_path_factory):
    """v1's own run under DDP, LoRA + ``modules_to_save: [lm_head]``: the reference of two tests below."""
    return _run(assets, tmp_path_factory.mktemp("v1_plain_ddp") / "mts_plain", "mts", False, dist_config=None)


def _pair(assets, tmp_path, head, command="sft", plain=None, both=False, **overrides):
    """The plugin's run against v1's own: its log (and v1's own run's, ``both``)."""
    runs = {False: plain or _run(assets, tmp_path / f"{head}_plain", head, False, command, **overrides),
            True: _run(assets, tmp_path / f"{head}_plugin", head, True, command, **overrides)}
    (_, plain_losses, plain_w), (log, plugin_losses, plugin_w) = runs[False], runs[True]
    assert len(plain_losses) == 3 and all(rel(a, b) < 1e-5 for a, b in zip(plugin_losses, plain_losses)), \
        (plugin_losses, plain_losses)
    assert plain_w.keys() == plugin_w.keys()
    for name, tensor in plain_w.items():
        assert rel(plugin_w[name], tensor) < 1e-4, name
    assert log.count("[liger_fsdp] engaged:") == 1 and "[liger_fsdp] guard: step 1 exact" in log, log[-6000:]
    return (log, runs[False][0]) if both else log


@pytest.mark.parametrize("head", ["mts", "lora", "full"])
def test_fsdp2_equals_v1s_own(assets, tmp_path, head):
    """Also: each decoder layer is an FSDP2 unit with the plugin. Where v1's own run finds no decoder-layer class
    (LLaMA-Factory 0.9.5, transformers 5, a PeftModel: its whole model is one unit) the plugin makes them units and its
    engaged line counts them on the live model (``isinstance(layer, FSDPModule)``); elsewhere it changes nothing."""
    log, plain_log = _pair(assets, tmp_path, head, both=True)
    assert "sharding=FSDP2" in log and UNITS[head] in log, log[-6000:]
    missed = "Could not identify Transformer Layer class" in plain_log  # v1's own run: one unit, the whole model
    assert "Applying per-layer FSDP to" in log and "Could not identify" not in log, log[-6000:]
    assert ("each decoder layer made a unit, as LLaMA-Factory git main does (2 of 2 are FSDP2 units)" in log) == missed
    if version("llamafactory") == "0.9.5":  # its finder misses a PeftModel's layers in transformers 5
        assert missed == (head != "full"), plain_log[-6000:]


def test_ddp_equals_v1s_own(assets, tmp_path, plain_ddp):
    log = _pair(assets, tmp_path, "mts", plain=plain_ddp, dist_config=None)
    assert "sharding=DDP" in log and "on the whole (unpartitioned) head weight" in log, log[-6000:]


def _zero3(tmp_path, bf16):
    import json

    ds = tmp_path / f"zero3_{bf16}.json"
    ds.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                              "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True}}))
    return {"name": "deepspeed", "config_file": str(ds)}


def test_zero3_equals_v1s_own(assets, tmp_path):
    """v1's DeepSpeed engine, ZeRO-3, full fine-tuning: the head weight is gathered by DeepSpeed's own hooks."""
    pytest.importorskip("deepspeed")
    log = _pair(assets, tmp_path, "full", dist_config=_zero3(tmp_path, False))
    assert "sharding=DeepSpeed ZeRO-3" in log and "through DeepSpeed's gather hooks of 1 module(s) (lm_head)" in log, \
        log[-6000:]


def test_dpo_equals_v1s_own(assets, tmp_path):
    """v1's DPO trainer (git main): sigmoid, LoRA as the reference, FSDP2."""
    from llamafactory.v1.trainers import dpo_trainer

    if not hasattr(dpo_trainer, "DPOTrainer"):
        pytest.skip("this LLaMA-Factory's v1 has no DPO trainer")
    log = _pair(assets, tmp_path, "mts", command="dpo")
    assert "patched llamafactory.v1.trainers.dpo_trainer.DPOTrainer.compute_loss" in log, log[-6000:]


def test_fsdp2_trains_the_seeds_adapter(assets, tmp_path):
    """LoRA + ``modules_to_save: [lm_head, embed_tokens]`` (the seed's adapter) under v1's FSDP2: with the plugin it
    trains, equal to v1's own run under DDP, whether or not the installed v1 still shards the untied embedding copy
    twice (where it does, the plugin leaves the second call alone and says so once; v1 alone stops on it)."""
    mts = {"name": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all", "modules_to_save": ["lm_head",
                                                                                                 "embed_tokens"]}
    runs = {}
    for name, plugin, dist in (("plugin_fsdp2", True, {"name": "fsdp2"}), ("plain_ddp", False, None)):
        out = tmp_path / name
        rc, log = run_v1(v1_yaml(assets, out, plugin=plugin, peft_config=mts, dist_config=dist))
        assert rc == 0, log[-6000:]
        runs[name] = (log, losses(out), weights(out))
    log = runs["plugin_fsdp2"][0]
    assert UNITS["mts"] in log and log.count("already a unit") <= 1, log[-6000:]  # v1's double call: once at most
    assert all(rel(a, b) < 1e-5 for a, b in zip(runs["plugin_fsdp2"][1], runs["plain_ddp"][1]))
    for name, tensor in runs["plain_ddp"][2].items():
        assert rel(runs["plugin_fsdp2"][2][name], tensor) < 1e-4, name


def test_freeze_with_trained_head_equals_v1s_own(assets, tmp_path):
    """v1's freeze tuning (git main) with ``freeze_extra_modules: lm_head``: the head is trained in fp32 and, under
    v1's FSDP2, a unit of its own through the plugin (v1 leaves it in the root unit)."""
    from llamafactory.v1.plugins.model_plugins import peft as v1_peft

    if "freeze" not in getattr(v1_peft.PeftPlugin, "_registry", {}):
        pytest.skip("this LLaMA-Factory's v1 has no freeze tuning")
    freeze = {"name": "freeze", "freeze_trainable_layers": 1, "freeze_trainable_modules": "all",
              "freeze_extra_modules": "lm_head"}
    log = _pair(assets, tmp_path, "full", peft_config=freeze)
    assert UNITS["full"] in log and "head=full" in log, log[-6000:]


def test_zero3_lora_trains_where_v1_stops(assets, tmp_path, plain_ddp):
    """ZeRO-3 + LoRA + ``modules_to_save`` in bf16 (DeepSpeed's ``auto``): v1 alone stops before step 1 (LoRA fp32
    beside the bf16 head copy: DeepSpeed's mixed-dtype assertion, asserted on the default engine by
    test_e2e_deepspeed.py); the plugin casts the trainable parameters to the compute dtype, as on the default engine,
    and trains -- its losses equal v1's own fp32 DDP run to bf16 rounding."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "plugin_zero3"
    rc, log = run_v1(v1_yaml(assets, out, dist_config=_zero3(tmp_path, "auto")))
    assert rc == 0, log[-6000:]
    assert "trainable parameters in the compute dtype" in log and "sharding=DeepSpeed ZeRO-3" in log
    assert "[liger_fsdp] guard: step 1 exact" in log, log[-6000:]
    fused, plain = losses(out), plain_ddp[1]
    assert len(fused) == len(plain) == 3 and all(rel(a, b) < 5e-3 for a, b in zip(fused, plain)), (fused, plain)
