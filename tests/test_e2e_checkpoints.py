"""Real `llamafactory-cli` runs of LoRA + embed_tokens/lm_head on 2 CPU ranks (gloo): under FSDP2 and FSDP1 the
losses with `liger_fsdp: true` are the plain run's; and nothing is lost: checkpoints, resume and export under FSDP2.
(One module, so the plain and the plugin's FSDP2 runs, each ~40 s, serve both.)

FSDP1 checkpoints are not covered: on CPU/gloo FSDP1 + PEFT modules_to_save cannot write any checkpoint
(PEFT's save_pretrained issues a collective on rank 0 only; see llamafactory_liger_fsdp/testing/cpu_fsdp_shim), with or
without the plugin.

Every comparison is fp32 and relative: per-step losses against the plain run rel <= 1e-4, a resumed run against the
uninterrupted one rel <= 1e-5, logits ||a-b|| / ||b|| <= 1e-5.
"""

import re
import shutil
from pathlib import Path

import pytest
import torch

from support.cli import (FSDP1, FSDP2, assert_same_losses, base_yaml, build, export_logits, peft_logits, run_cli,
                         step_losses)

from llamafactory_liger_fsdp.testing import rel

pytestmark = pytest.mark.slow

TOL = 1e-5
SAVES = dict(save_strategy="steps", save_steps=2)


def _yaml(assets, out, **kw):
    return base_yaml(assets, out, liger_fsdp=True, **SAVES, **FSDP2, **kw)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted 6-step run (checkpoints at 2, 4, 6), with accelerate's default state-dict
    type (the plugin picks FULL_STATE_DICT), and the trained sharded model's logits."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    logits = out.parent / "reference_logits.pt"
    rc, log, _ = run_cli(
        _yaml(assets, out), nproc=2, extra_env={"FSDP_STATE_DICT_TYPE": None, "CPU_FSDP_SHIM_LOGITS": str(logits)}
    )
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] FSDP2 + adapter: using fsdp_state_dict_type FULL_STATE_DICT" in log
    assert "[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=FSDP2" in log
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step in (2, 4, 6):
        assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    return out, losses, torch.load(logits), log


@pytest.fixture(scope="module")
def plain(assets, tmp_path_factory):
    """The same 6-step FSDP2 run without the plugin (checkpoints at 2, 4, 6): the reference of the parity tests and
    the writer of the plain checkpoint the plugin resumes."""
    out = tmp_path_factory.mktemp("runs") / "plain"
    rc, log, _ = run_cli(base_yaml(assets, out, **SAVES, **FSDP2), nproc=2)
    assert rc == 0, log[-6000:]
    assert "[cpu_fsdp_shim] forced DistributedType.FSDP (fsdp_version=2)" in log
    assert "[liger_fsdp]" not in log  # the plugin is silent without the flag
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return out, [losses[s] for s in sorted(losses)]


def test_fsdp2_two_ranks(reference, plain):
    """The reference run itself: engaged once (rank 0, on a line of its own), the head computed through its own FSDP2
    unit, the losses the plain run's, and a full (unsharded) head in the saved adapter."""
    out, losses, _, log = reference
    engaged = [l for l in log.splitlines() if "[liger_fsdp] engaged" in l]
    assert len(engaged) == 1, engaged  # rank 0 only, once
    # on a line of its own in the log file, not glued to the Trainer's progress bar (str.splitlines splits at \r)
    assert [l for l in log.split("\n") if l.startswith("[liger_fsdp] engaged")] == engaged, repr(log[-3000:])
    # the trained copy is its own unit; accelerate >= 1.15 also groups [final norm, lm_head wrapper] into a unit
    # (its "tail"), which the loss then passes through as well
    assert re.search(
        r"\[liger_fsdp\] engaged: head=modules_to_save \(lm_head\), sharding=FSDP2, backend=torch, model=llama "
        r"\(LlamaForCausalLM; quirks: none\), guard=on; "
        r"loss computed through (1 FSDP unit\(s\) \(|2 FSDP unit\(s\) \(lm_head, )lm_head\.modules_to_save\.default\)$",
        engaged[0],
    ), engaged[0]
    assert_same_losses([losses[s] for s in sorted(losses)], plain[1])
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        head_w = f.get_tensor("base_model.model.lm_head.weight")
    assert "base_model.model.model.embed_tokens.weight" in keys
    assert any("lora_A" in k for k in keys) and any("lora_B" in k for k in keys)
    assert tuple(head_w.shape) == (384, 64)  # the full head, not a shard


def test_fsdp1_two_ranks(assets, tmp_path, plain):
    """FSDP1 (flat parameters, LLaMA-Factory's PEFT wrap policy): the same math as the unfused FSDP2 run (FSDP1 on
    CPU/gloo cannot write this adapter's checkpoints, see the module's note, so this run saves nothing)."""
    out = tmp_path / "fsdp1_liger"
    rc, log, losses = run_cli(base_yaml(assets, out, liger_fsdp=True, **FSDP1), nproc=2, fsdp1=True)
    assert rc == 0, log[-6000:]
    assert "[cpu_fsdp_shim] forced DistributedType.FSDP (fsdp_version=1)" in log
    assert re.search(
        r"\[liger_fsdp\] engaged: head=modules_to_save \(lm_head\), sharding=FSDP1, .*through 1 FSDP unit\(s\) "
        r"\(lm_head\.modules_to_save\.default\)", log
    )
    assert_same_losses(losses, plain[1])


def _assert_curve(losses, ref, steps):
    assert sorted(losses) == list(steps), losses
    worst = max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in steps)
    assert worst <= TOL, (losses, ref)
    return worst


def _copy_checkpoint(src: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    shutil.copytree(src, out / src.name)
    return out / src.name


def test_adapter_in_plain_peft_gives_trained_logits(assets, reference):
    out, _, dumped, _ = reference
    logits = peft_logits(assets, out, dumped["input_ids"])
    diff = rel(logits, dumped["logits"])
    print("plain PEFT vs sharded logits rel", diff)
    assert diff <= TOL
    # the trained head really moved: logits differ from the base model's
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(assets / "model")).eval()(input_ids=dumped["input_ids"]).logits
    assert rel(base, dumped["logits"]) > 1e-3


def test_export_merged_gives_trained_logits(assets, reference, tmp_path):
    out, _, dumped, _ = reference
    diff = rel(export_logits(assets, out, tmp_path, dumped["input_ids"]), dumped["logits"])
    print("merged export vs sharded logits rel", diff)
    assert diff <= TOL


def test_rank_killed_while_saving(assets, reference, tmp_path):
    """Rank 0 dies (SIGKILL) while writing checkpoint-4, after weights and optimizer, before
    trainer_state.json. The half-written checkpoint is refused when named, skipped when
    LLaMA-Factory picks it by itself; the run resumed from checkpoint-2 equals the uninterrupted one, its curve and
    its final adapter (resuming a named complete checkpoint: the plain -> plugin and frozen-head tests below)."""
    from safetensors.torch import load_file

    ref_out, ref, _, _ = reference
    out = tmp_path / "killed"
    rc, log, _ = run_cli(_yaml(assets, out), nproc=2, extra_env={"CPU_FSDP_SHIM_KILL": "save:4:0"})
    assert rc != 0 and "[cpu_fsdp_shim] killing rank 0 while saving checkpoint-4" in log
    assert (out / "checkpoint-4" / "pytorch_model_fsdp.bin").is_file()
    assert not (out / "checkpoint-4" / "trainer_state.json").exists()

    rc, log, _ = run_cli(_yaml(assets, out, resume_from_checkpoint=str(out / "checkpoint-4")), nproc=2)
    assert rc != 0
    assert (
        f"`resume_from_checkpoint: {out / 'checkpoint-4'}` is an incomplete checkpoint: no trainer_state.json "
        f"(the Trainer writes it last). The run that wrote it was interrupted while saving. Fix: point "
        f"`resume_from_checkpoint` at a complete one (newest: {out / 'checkpoint-2'})." in log
    )

    rc, log, _ = run_cli(_yaml(assets, out), nproc=2)  # same yaml again: LLaMA-Factory auto-resumes
    assert rc == 0, log[-6000:]
    assert f"[liger_fsdp] resume: {out / 'checkpoint-4'} is incomplete" in log
    assert f"Resuming training from {out / 'checkpoint-2'}." in log  # LLaMA-Factory's own line names the right one
    assert f"Resuming training from {out / 'checkpoint-4'}" not in log
    assert "Resuming training from checkpoint with epoch 0 and global step 2" in log
    print("killed-in-save resume rel diff", _assert_curve(step_losses(out), ref, range(1, 7)))
    a, b = load_file(out / "adapter_model.safetensors"), load_file(ref_out / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert max(rel(a[k], b[k]) for k in a) <= TOL


def _why_it_failed(log: str) -> str:
    """The log's tail and, before it, the lines of a native abort or of rank 0 from anywhere in the log (a rank that
    aborts in C++ -- seen once: rank 0 SIGABRT in the resumed run -- leaves its cause far above the tail)."""
    marks = ("[rank0]", "terminate called", "what():", "SIGABRT", "Signal 6", "Fatal Python error", "gloo")
    lines = [line for line in log.splitlines() if any(m in line for m in marks)]
    return "\n".join(lines[-60:]) + "\n----- tail -----\n" + log[-4000:]


def test_rank_killed_mid_step(assets, reference, tmp_path):
    """Rank 1 dies inside step 5: checkpoint-4 is complete and the auto-resume continues from it."""
    _, ref, _, _ = reference
    out = tmp_path / "killed_step"
    rc, log, _ = run_cli(_yaml(assets, out), nproc=2, extra_env={"CPU_FSDP_SHIM_KILL": "step:5:1"})
    assert rc != 0 and "[cpu_fsdp_shim] killing rank 1 in step 5" in log
    rc, log, _ = run_cli(_yaml(assets, out), nproc=2)
    assert rc == 0, _why_it_failed(log)
    assert "Resuming training from checkpoint with epoch 0 and global step 4" in log
    assert "is incomplete" not in log
    print("killed-mid-step resume rel diff", _assert_curve(step_losses(out), ref, range(1, 7)))


def test_plain_fsdp2_checkpoint_resumes_with_plugin(assets, reference, plain, tmp_path):
    """A checkpoint written without the plugin resumes with it. accelerate <= 1.11 wrote only rank
    0's DTensor shards into pytorch_model_fsdp.bin: the plugin reads the checkpoint's full
    adapter_model.safetensors instead; accelerate >= 1.15 writes full tensors, read as they are."""
    _, ref, _, _ = reference
    out = tmp_path / "plain_then_plugin"
    ckpt = _copy_checkpoint(plain[0] / "checkpoint-2", out)
    rc, log, _ = run_cli(_yaml(assets, out, resume_from_checkpoint=str(ckpt)), nproc=2)
    assert rc == 0, log[-6000:]
    fallback = "holds only rank 0's FSDP2 shards (written without the plugin); loading the full adapter from"
    assert (fallback in log) is not _accelerate_resumes_fsdp2_adapters()
    print("plain->plugin FSDP2 resume rel diff", _assert_curve(step_losses(out), ref, range(3, 7)))


def _accelerate_resumes_fsdp2_adapters() -> bool:
    """accelerate fixed its FSDP2 adapter checkpoints (full tensors via get_model_state_dict) by 1.15
    (seen there); 1.11, what LLaMA-Factory 0.9.5 pins, cannot resume any FSDP2 adapter checkpoint."""
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__) >= Version("1.15.0")


@pytest.mark.skipif(not _accelerate_resumes_fsdp2_adapters(), reason="plain accelerate < 1.15 cannot resume FSDP2 adapters at all")
def test_plugin_fsdp2_checkpoint_resumes_without_plugin(assets, reference, tmp_path):
    """The plugin writes accelerate's own (fixed) format, so plain accelerate >= 1.15 resumes it."""
    ref_out, ref, _, _ = reference
    out = tmp_path / "plugin_then_plain"
    ckpt = _copy_checkpoint(ref_out / "checkpoint-4", out)
    rc, log, _ = run_cli(base_yaml(assets, out, resume_from_checkpoint=str(ckpt), **SAVES, **FSDP2), nproc=2)
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp]" not in log
    print("plugin->plain FSDP2 resume rel diff", _assert_curve(step_losses(out), ref, range(5, 7)))


def test_cross_resume_one_process(assets, tmp_path):
    """Without FSDP (one process): plain -> plugin and plugin -> plain resumes equal the plain run."""
    cfg = dict(**SAVES)
    plain = tmp_path / "plain"
    rc, log, _ = run_cli(base_yaml(assets, plain, **cfg))
    assert rc == 0, log[-6000:]
    ref = step_losses(plain)

    plugin = tmp_path / "plugin"
    ckpt = _copy_checkpoint(plain / "checkpoint-2", plugin)
    rc, log, _ = run_cli(base_yaml(assets, plugin, liger_fsdp=True, resume_from_checkpoint=str(ckpt), **cfg))
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] engaged" in log
    print("plain->plugin resume rel diff", _assert_curve(step_losses(plugin), ref, range(3, 7)))

    back = tmp_path / "back"
    ckpt = _copy_checkpoint(plugin / "checkpoint-4", back)
    rc, log, _ = run_cli(base_yaml(assets, back, resume_from_checkpoint=str(ckpt), **cfg))
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp]" not in log
    print("plugin->plain resume rel diff", _assert_curve(step_losses(back), ref, range(5, 7)))


def test_tied_embeddings_survive(tmp_path_factory, tmp_path):
    """Qwen2 with tie_word_embeddings and both embed_tokens and lm_head trained (PEFT makes two
    untied copies): resume, plain-PEFT load and merged export all keep the trained head."""
    assets = build(tmp_path_factory.mktemp("tied_assets"), "--model-type", "qwen2", "--tied")
    fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config=dict(version=2, transformer_layer_cls_to_wrap="Qwen2DecoderLayer"))
    ref_out = tmp_path / "ref"
    logits_file = tmp_path / "logits.pt"
    cfg = dict(liger_fsdp=True, max_steps=4, **SAVES, **fsdp)
    rc, log, _ = run_cli(base_yaml(assets, ref_out, **cfg), nproc=2, extra_env={"CPU_FSDP_SHIM_LOGITS": str(logits_file)})
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] engaged: head=modules_to_save (lm_head), sharding=FSDP2" in log
    ref, dumped = step_losses(ref_out), torch.load(logits_file)

    out = tmp_path / "resumed"
    ckpt = _copy_checkpoint(ref_out / "checkpoint-2", out)
    rc, log, _ = run_cli(base_yaml(assets, out, resume_from_checkpoint=str(ckpt), **cfg), nproc=2)
    assert rc == 0, log[-6000:]
    print("tied resume rel diff", _assert_curve(step_losses(out), ref, range(3, 5)))

    rel_peft = rel(peft_logits(assets, ref_out, dumped["input_ids"]), dumped["logits"])
    rel_merged = rel(export_logits(assets, ref_out, tmp_path, dumped["input_ids"]), dumped["logits"])
    print("tied plain PEFT / merged vs sharded logits rel", rel_peft, rel_merged)
    assert rel_peft <= TOL and rel_merged <= TOL


def test_frozen_head_fsdp2_checkpoints_resume(assets, tmp_path):
    """A frozen head (LoRA + `additional_target: embed_tokens` only) under FSDP2: the fused loss does not engage
    (one line says so), and still every checkpoint holds full tensors and resumes on both ranks where the installed
    accelerate (< 1.15) writes rank 0's FSDP2 shards only -- the checkpoint repair does not depend on engaging."""
    from safetensors.torch import load_file

    from llamafactory_liger_fsdp.thirdparty import is_dtensor

    frozen = dict(additional_target="embed_tokens", max_steps=4)
    embed = "base_model.model.model.embed_tokens.modules_to_save.default.weight"  # the trained copy, model names
    ref_out = tmp_path / "frozen_ref"
    rc, log, _ = run_cli(_yaml(assets, ref_out, **frozen), nproc=2)
    assert rc == 0, log[-6000:]
    assert "[liger_fsdp] not engaged: lm_head is frozen" in log
    assert "[liger_fsdp] engaged" not in log
    ref = step_losses(ref_out)
    assert sorted(ref) == [1, 2, 3, 4], ref

    final = load_file(ref_out / "adapter_model.safetensors")
    assert not any("lm_head" in k for k in final), sorted(final)
    assert tuple(final["base_model.model.model.embed_tokens.weight"].shape) == (384, 64)
    for step in (2, 4):
        ckpt = ref_out / f"checkpoint-{step}"
        adapter = load_file(ckpt / "adapter_model.safetensors")
        assert adapter.keys() == final.keys()
        assert all(adapter[k].shape == final[k].shape for k in final)
        # what the Trainer resumes from: full tensors of every trained parameter, not rank 0's DTensor shards
        saved = torch.load(ckpt / "pytorch_model_fsdp.bin", map_location="cpu", weights_only=False)
        shards = sorted(k for k, v in saved.items() if is_dtensor(v))
        assert not shards, f"checkpoint-{step} holds rank 0's FSDP2 shards: {shards[:3]}"
        assert tuple(saved[embed].shape) == (384, 64), (step, sorted(saved)[:5])
        assert len(saved) == len(final)  # each trained parameter once (LoRA A/B of every target, the embed copy)
    assert torch.equal(load_file(ref_out / "checkpoint-4" / "adapter_model.safetensors")[
        "base_model.model.model.embed_tokens.weight"], final["base_model.model.model.embed_tokens.weight"])

    out = tmp_path / "frozen_resumed"
    ckpt = _copy_checkpoint(ref_out / "checkpoint-2", out)
    rc, log, _ = run_cli(_yaml(assets, out, resume_from_checkpoint=str(ckpt), **frozen), nproc=2)
    assert rc == 0, log[-6000:]
    assert "Resuming training from checkpoint with epoch 0 and global step 2" in log
    print("frozen head FSDP2 resume rel diff", _assert_curve(step_losses(out), ref, range(3, 5)))
    resumed = load_file(out / "adapter_model.safetensors")
    assert resumed.keys() == final.keys()
    assert max(rel(resumed[k], final[k]) for k in final) <= TOL
