"""End to end on a vision-language model: `llamafactory-cli train` on a tiny local Qwen2-VL (random weights, a
processor built here: BPE tokenizer with the qwen2_vl template's special tokens + Qwen2-VL image processor) and a
tiny local image dataset in LLaMA-Factory's multimodal sharegpt format (PNG files written here); nothing is
downloaded. Flag on vs off: per-step losses equal (rel <= 1e-4), the guard passes, the engaged line names the class."""

import json
import random

import pytest

from support.cli import run_cli

pytestmark = pytest.mark.slow

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
WORDS = "the image shows a red blue green square circle cat dog on left right top bottom what color shape is".split()


def _rows(n=16, seed=0):
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [{"messages": [{"role": "user", "content": f"<image>{say(rng.randint(3, 8))}?"},
                          {"role": "assistant", "content": say(rng.randint(4, 12)) + "."}],
             "images": [f"images/{i % 4}.png"]} for i in range(n)]


def build(root):
    import torch
    from PIL import Image
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (AutoModelForImageTextToText, PreTrainedTokenizerFast, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from llamafactory_liger_fsdp.testing import make_config

    data, model_dir = root / "data", root / "model"
    (data / "images").mkdir(parents=True)
    rows = _rows()
    (data / "tiny_mm.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"tiny_mm": {
        "file_name": "tiny_mm.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    for i, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0)]):
        Image.new("RGB", (56, 56), color).save(data / "images" / f"{i}.png")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([m["content"] for r in rows for m in r["messages"]] * 4 + ["You are a helpful assistant."],
                            trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIAL,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
                     video_processor=Qwen2VLVideoProcessor(), tokenizer=fast,
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(model_dir)
    config = make_config("qwen2_vl")
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL}
    config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    config.text_config.eos_token_id, config.text_config.pad_token_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(model_dir)
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
