"""End to end on a vision-language model: `llamafactory-cli train` on a tiny local Qwen2-VL (random weights, a
processor built here: BPE tokenizer with the qwen2_vl template's special tokens + Qwen2-VL image processor) and a
tiny local image dataset in LLaMA-Factory's multimodal sharegpt format (PNG files written here); nothing is
downloaded. Flag on vs off: per-step losses equal (rel <= 1e-4), the guard passes, the engaged line names the class."""

import pytest

from support.cli import run_cli

pytestmark = pytest.mark.slow


def build(root):
    import torch
    from transformers import AutoModelForImageTextToText

    from llamafactory_liger_fsdp.testing import make_config, vlm_assets

    rows = vlm_assets.rows(16, (4, 12))
    vlm_assets.write_data(str(root / "data"), rows, 56)
    wire = vlm_assets.save_processor(str(root / "model"), rows, 56 * 56, 112 * 112)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(wire(make_config("qwen2_vl"))).save_pretrained(root / "model")
    return root


def _yaml(assets, out, **kw):
    cfg = dict(model_name_or_path=str(assets / "model"), stage="sft", do_train=True, finetuning_type="lora",
               lora_target="all", lora_rank=4, additional_target="embed_tokens,lm_head", dataset="tiny_mm",
               dataset_dir=str(assets / "data"), template="qwen2_vl", cutoff_len=128, overwrite_cache=True,
               preprocessing_num_workers=1, output_dir=str(out), logging_steps=1, save_strategy="no",
               per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1.0e-3, max_steps=4,
               lr_scheduler_type="constant", report_to="none", seed=0, use_cpu=True, image_max_pixels=112 * 112,
               image_min_pixels=56 * 56)
    cfg.update(kw)
    return cfg


def test_qwen2_vl_cli_flag_on_vs_off(tmp_path):
    assets = build(tmp_path / "assets")
    rc, log, plain = run_cli(_yaml(assets, tmp_path / "plain"))
    assert rc == 0 and len(plain) == 4, log[-6000:]
    rc, log, fused = run_cli(_yaml(assets, tmp_path / "fused", liger_fsdp=True))
    assert rc == 0 and len(fused) == 4, log[-6000:]
    assert "model=qwen2_vl (Qwen2VLForConditionalGeneration; quirks: none), guard=on" in log, log[-4000:]
    assert "[liger_fsdp] guard: step 1 exact: model's own loss" in log
    assert "(decoder on the whole micro-batch)" in log  # pixel values and grids went in: not split by row
    for a, b in zip(fused, plain):
        assert abs(a - b) <= 1e-4 * abs(b), (fused, plain)
