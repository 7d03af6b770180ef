"""LLaMA-Factory's v1 engine, in process: the kernel ``liger_fsdp`` registered in the installed v1 (0.9.5's function
registry or git main's BaseKernel one), ``BaseTrainer.compute_log_probs`` answered by the fused kernel with the
original's log-probs and gradients (every head kind, v1's loss weights), no [N, V] tensor, the original forward for any
other training call, and the refusals of a v1 yaml. The multi-process runs are in ``test_v1_dist.py``."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llamafactory.v1")

from llamafactory_liger_fsdp import engage, forward  # noqa: E402
from llamafactory_liger_fsdp.config import LigerFsdpConfigError  # noqa: E402
from llamafactory_liger_fsdp.integration.v1 import args as v1_args  # noqa: E402
from llamafactory_liger_fsdp.integration.v1 import engine as v1  # noqa: E402
from llamafactory_liger_fsdp.integration.v1.cp_args import as_yaml  # noqa: E402
from llamafactory_liger_fsdp.testing import VOCAB, make_batch, make_model, make_peft, rel  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_run():
    v1._RUN["config"] = None
    yield
    v1._RUN["config"] = None


def apply_kernel(model, kernel_config=None):
    """What v1's ModelEngine does with ``kernel_config`` in the installed version."""
    from llamafactory.v1.plugins.model_plugins.kernels import interface

    kernel_config = kernel_config or {"name": v1_args.NAME}
    if hasattr(interface, "apply_kernels"):  # git main
        return interface.apply_kernels(model, kernel_config, require_logits=True)
    v1._RUN["config"] = v1_args.config_of(kernel_config)  # 0.9.5's kernels get no kernel_config: get_args keeps it
    plugin = interface.KernelPlugin(kernel_config["name"])
    return plugin(model=model, include_kernels=kernel_config.get("include_kernels"))


def frozen_head(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8,
                                            init_lora_weights=False))


def build(head: str, name: str = "llama"):
    base = make_model(name)
    return frozen_head(base) if head == "frozen" else make_peft(base, head)


def sft_loss(model, batch, step=1):
    """v1's SFTTrainer.compute_loss on a stand-in trainer (CPU; git main's mRoPE flag as its trainer sets it)."""
    from llamafactory.v1.core.base_trainer import BaseTrainer
    from llamafactory.v1.utils import helper

    uses_mrope = helper.model_uses_mrope(model.config) if hasattr(helper, "model_uses_mrope") else False
    trainer = SimpleNamespace(device=torch.device("cpu"), _uses_mrope=uses_mrope, global_step=step)
    logps = BaseTrainer.compute_log_probs(trainer, model, batch)
    w = batch["loss_weights"][..., 1:]
    return logps, (-logps * w).sum() / (w.sum() + 1e-6)


def v1_batch(seed=0):
    batch = make_batch(batch=2, seq=16, seed=seed)
    weights = (batch["labels"] != -100).float()
    weights[0] *= 0.5  # v1 weights samples per token
    return dict(batch, loss_weights=weights)


def test_registered_in_the_installed_v1():
    from llamafactory.v1.plugins.model_plugins.kernels import interface

    model = build("mts")
    assert apply_kernel(model) is model
    done = engage.engaged(model)
    assert done is not None and done.head.kind == "modules_to_save"
    assert forward.state_of(engage.causal_lm_of(model)).request_only
    shape = "BaseKernel classes, git main" if hasattr(interface, "apply_kernels") else "functions, 0.9.5"
    from llamafactory_liger_fsdp import _patch

    assert any(shape in p.why and v1_args.NAME in p.where for p in _patch._APPLIED)
    engage.disengage(model)
    from llamafactory.v1.core.base_trainer import BaseTrainer

    assert not getattr(BaseTrainer.compute_log_probs, _patch.MARK, False)


@pytest.mark.parametrize("head, name", [("mts", "llama"), ("lora", "llama"), ("full", "llama"), ("frozen", "llama"),
                                        ("mts", "qwen2_tied"), ("mts", "gemma2")])
def test_compute_log_probs_equals_v1s_own(head, name):
    """Per-token log-probs and every gradient of v1's SFT loss equal the unpatched method's (fp32, 1e-5)."""
    ref = build(head, name)
    cand = copy.deepcopy(ref)
    apply_kernel(cand)
    try:
        batch = v1_batch()
        for model in (ref, cand):
            model.train()
        ref_lp, ref_loss = sft_loss_unpatched(ref, batch)
        cand_lp, cand_loss = sft_loss(cand, batch)
        assert rel(cand_lp, ref_lp) < 1e-5 and (cand_lp[batch["labels"][:, 1:] == -100] == 0).all()
        ref_loss.backward()
        cand_loss.backward()
        assert rel(cand_loss, ref_loss) < 1e-5
        assert_same_grads(cand, ref)
    finally:
        engage.disengage(cand)


def assert_same_grads(cand, ref, tol=1e-5):
    """Every trainable parameter of ``ref`` has a gradient, and ``cand``'s equals it within ``tol`` (relative)."""
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    for n, p in cand.named_parameters():
        if p.requires_grad:
            assert rel(p.grad, grads[n]) < tol, n


def test_vision_language_model_equals_v1s_own():
    """Qwen2.5-VL with images: pixel values, grid sizes and (on git main) the mRoPE position-id pop pass through the
    captured inputs; log-probs and gradients as v1's own."""
    from llamafactory_liger_fsdp.testing import make_inputs

    ref = make_peft(make_model("qwen2_5_vl"), "mts")
    cand = copy.deepcopy(ref)
    apply_kernel(cand)
    try:
        batch = make_inputs("qwen2_5_vl")
        batch["loss_weights"] = (batch["labels"] != -100).float()
        for model in (ref, cand):
            model.train()
        ref_lp, ref_loss = sft_loss_unpatched(ref, batch)
        cand_lp, cand_loss = sft_loss(cand, batch)
        assert rel(cand_lp, ref_lp) < 1e-5
        ref_loss.backward()
        cand_loss.backward()
        assert_same_grads(cand, ref)
    finally:
        engage.disengage(cand)


def sft_loss_unpatched(model, batch):
    """The same loss through v1's own method (the model is not engaged, so the patch delegates to it)."""
    assert engage.engaged(model) is None
    return sft_loss(model, batch)


def test_no_logits_built():
    """Inside the patched compute_log_probs no storage of N x V elements or more is allocated (forward and
    backward); the unpatched method allocates the fp32 logits."""
    from support.kernel import StorageTrace

    ref = build("mts")
    cand = copy.deepcopy(ref)
    apply_kernel(cand, {"name": v1_args.NAME, "liger_fsdp_guard": False, "liger_fsdp_backend": "triton"})
    try:
        batch = dict(make_batch(batch=2, seq=64))
        batch["loss_weights"] = (batch["labels"] != -100).float()
        n_v = batch["input_ids"].numel() * VOCAB
        for model, expect in ((ref, True), (cand, False)):
            model.train()
            with StorageTrace() as trace:
                _, loss = sft_loss(model, batch)
                loss.backward()
            big = [a for a in trace.allocated if len(a[1]) and torch.Size(a[1]).numel() >= n_v]
            assert bool(big) is expect, big
    finally:
        engage.disengage(cand)


def test_other_training_calls_keep_their_logits(caplog):
    """request-only: a training forward with labels outside compute_log_probs (v1 DPO, a callback) gets the model's
    own output, logits included, and the plugin says once that it stepped aside."""
    model = build("mts")
    apply_kernel(model)
    try:
        model.train()
        batch = make_batch()
        out = model(**batch)
        assert out.logits is not None and out.logits.shape[-1] == VOCAB and out.loss is not None
        assert forward.state_of(engage.causal_lm_of(model)).said_no_labels
    finally:
        engage.disengage(model)


def test_guard_runs_on_the_first_request(caplog):
    import logging

    model = build("lora")
    apply_kernel(model)
    try:
        model.train()
        with caplog.at_level(logging.INFO):
            sft_loss(model, v1_batch(), step=7)
            sft_loss(model, v1_batch(seed=1), step=8)
        lines = [r.getMessage() for r in caplog.records if "guard:" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("[liger_fsdp] guard: step 7 exact"), lines
    finally:
        engage.disengage(model)


def test_kernel_config_keys():
    assert v1_args.config_of({"name": "liger_fsdp"}).enabled
    assert not v1_args.config_of({"name": "liger_kernel"}).enabled
    cfg = v1_args.config_of({"name": "liger_kernel, liger_fsdp", "liger_fsdp_guard": "false",
                             "liger_fsdp_backend": "torch"})
    assert cfg.enabled and not cfg.guard and cfg.backend == "torch"
    assert v1_args.config_of('{"name": "liger_fsdp"}').enabled  # v1 takes JSON strings
    with pytest.raises(LigerFsdpConfigError, match="Unknown key.*liger_fsdp_gaurd"):
        v1_args.config_of({"name": "liger_fsdp", "liger_fsdp_gaurd": False})
    with pytest.raises(LigerFsdpConfigError, match="does not list `liger_fsdp`.*Fix"):
        v1_args.config_of({"name": "auto", "liger_fsdp_guard": False})
    with pytest.raises(LigerFsdpConfigError, match="inside `kernel_config`.*Fix: `kernel_config: {name: liger_fsdp}`"):
        v1_args.top_level_keys({"liger_fsdp": True})


@pytest.mark.parametrize("command, values, match", [
    ("rm", {}, "reward-model trainer"),
    (None, {"model_class": "cls"}, "reward-model trainer"),
    (None, {"cp_size": 2}, "`cp_size: 2`"),
    (None, {**as_yaml(4, "ring"), "flash_attn": "flash_attention_2"}, "cp_mode: ring`"),
    (None, {"dist_config": {"name": "fsdpturbo"}}, "`dist_config.name: fsdpturbo`"),
])
def test_refusals(command, values, match):
    with pytest.raises(LigerFsdpConfigError, match=match) as err:
        v1_args.check(command, {"kernel_config": {"name": "liger_fsdp"}, **values})
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize("yaml, expected", [
    ("liger_fsdp: true\n", "`liger_fsdp`: on LLaMA-Factory's v1 engine"),
    ("kernel_config: {name: liger_fsdp}\ndist_config: {name: fsdpturbo}\n", "`dist_config.name: fsdpturbo`"),
    ("kernel_config: {name: liger_fsdp, liger_fsdp_gaurd: false}\n", "Unknown key(s) `liger_fsdp_gaurd`"),
])
def test_v1_launcher_precheck_refuses(tmp_path, yaml, expected):
    """The function v1's patched launcher runs before any rank starts, on the yaml's own words (one yaml end to end:
    test_bootstrap.py::test_v1_engine_refusals_before_any_rank)."""
    from llamafactory_liger_fsdp.integration.v1.engine import precheck

    cfg = tmp_path / "v1.yaml"
    cfg.write_text("model: whatever\n" + yaml)
    with pytest.raises(LigerFsdpConfigError) as err:
        precheck("sft", [str(cfg)])
    assert expected in str(err.value) and "Fix:" in str(err.value), str(err.value)


def test_versions_too_old_refused(monkeypatch):
    from llamafactory_liger_fsdp import versions

    monkeypatch.setattr(versions, "installed", lambda name: {"torch": "2.10.0"}.get(name))
    with pytest.raises(LigerFsdpConfigError, match=r"torch 2.10.0 \(needs >= 2.11\).*Fix: pip install 'torch>=2.11'"):
        v1_args.check("sft", {"kernel_config": {"name": "liger_fsdp"}})


def test_sharding_from_dist_config(tmp_path):
    import json

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    decide = v1_args.decide_sharding
    assert decide({"dist_config": {"name": "fsdp2"}}, {}).label == "FSDP2"
    assert decide({"dist_config": {"name": "deepspeed", "config_file": str(ds)}}, {}).label == \
        "DeepSpeed ZeRO-3 (param offload cpu)"
    assert decide({}, {"WORLD_SIZE": "2"}).label == "DDP" and decide({}, {}).label == "none"


def test_no_output_embedding_refused():
    from transformers import AutoModelForTokenClassification

    from llamafactory_liger_fsdp.testing import make_config

    cfg = make_config("llama")
    cfg.num_labels = 1
    model = AutoModelForTokenClassification.from_config(cfg)
    with pytest.raises(LigerFsdpConfigError, match="no output embedding.*Fix"):
        apply_kernel(model)


def test_doctor_reads_a_v1_yaml(assets, monkeypatch, capsys):
    """``doctor`` tells a v1 yaml apart (``model:``) and decides with v1's rules: the registry of the installed v1, the
    sharding, the model type, the head kind; a refusal is an error line and exit status 1."""
    import os

    from llamafactory_liger_fsdp import doctor

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_cpu",
                          "v1_sft.yaml")
    monkeypatch.setenv("LLAMAFACTORY_VERBOSITY", "WARN")
    assert doctor.main(["doctor", recipe, f"model={assets / 'model'}"]) == 0
    out = capsys.readouterr().out
    for line in (f"`{v1_args.NAME}` registered", "liger_fsdp: on", "sharding: FSDP2", "model type llama",
                 "will engage: head=modules_to_save"):
        assert line in out, out
    assert doctor.main(["doctor", recipe, f"model={assets / 'model'}", "dist_config.cp_size=2",
                        "dist_config.cp_mode=ring"]) == 1
    assert "error: `dist_config.cp_" in capsys.readouterr().out  # cp_mode: ring (0.9.5), 0.9.5's spelling (git main)
