"""Tiny offline vision-language assets: image rows in LLaMA-Factory's multimodal sharegpt format (PNG files written
here) and a Qwen2-VL / Qwen2.5-VL processor (a byte-level BPE carrying the qwen2_vl template's special tokens + the
image processor). Shared by tests/test_families_e2e.py (a tiny model) and bench/depth.py vlm (the 7B shape)."""

from __future__ import annotations

import json
import os
import random

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
WORDS = "the image shows a red blue green square circle cat dog on left right top bottom what color shape is".split()


def rows(n: int, answer_words: tuple[int, int], question_words: tuple[int, int] = (3, 8), seed: int = 0) -> list:
    """``n`` rows of one image each (four images, ``images/<i>.png``), answers of ``answer_words`` words."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [{"messages": [{"role": "user", "content": f"<image>{say(rng.randint(*question_words))}?"},
                          {"role": "assistant", "content": say(rng.randint(*answer_words)) + "."}],
             "images": [f"images/{i % 4}.png"]} for i in range(n)]


def write_data(data_dir: str, data_rows: list, side: int, noise: bool = False) -> None:
    """``data_dir``: the rows as dataset ``tiny_mm`` and four ``side`` x ``side`` images (solid colours, or ``noise``
    that an image processor's resize keeps as content)."""
    from PIL import Image

    os.makedirs(os.path.join(data_dir, "images"), exist_ok=True)
    rng = random.Random(1)
    for i, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0)]):
        image = (Image.frombytes("RGB", (side, side), bytes(rng.randrange(256) for _ in range(side * side * 3)))
                 if noise else Image.new("RGB", (side, side), color))
        image.save(os.path.join(data_dir, "images", f"{i}.png"))
    with open(os.path.join(data_dir, "tiny_mm.json"), "w") as f:
        json.dump(data_rows, f)
    with open(os.path.join(data_dir, "dataset_info.json"), "w") as f:
        json.dump({"tiny_mm": {"file_name": "tiny_mm.json", "formatting": "sharegpt",
                               "columns": {"messages": "messages", "images": "images"},
                               "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                        "assistant_tag": "assistant"}}}, f)


def save_processor(model_dir: str, data_rows: list, min_pixels: int, max_pixels: int, v2_5: bool = False):
    """The processor trained on ``data_rows``' texts, saved in ``model_dir``; returns ``wire(config)``, which sets a
    model config's special-token ids to the tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = [m["content"] for r in data_rows for m in r["messages"]] * 4 + ["You are a helpful assistant."]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    processor = Qwen2_5_VLProcessor if v2_5 else Qwen2VLProcessor
    processor(image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
              video_processor=Qwen2VLVideoProcessor(), tokenizer=fast,
              chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(model_dir)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL}

    def wire(config):
        config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
        config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
        config.text_config.eos_token_id, config.text_config.pad_token_id = ids["<|im_end|>"], ids["<|endoftext|>"]
        return config

    return wire
