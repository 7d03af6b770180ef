"""Build the tiny local assets the CPU recipe trains on: nothing is downloaded.

* a byte-level BPE tokenizer trained here with ``tokenizers`` on the dataset's own text, carrying
  the special tokens of LLaMA-Factory's ``llama3`` template (so nothing is resized);
* a 2-layer Llama (hidden 64, random weights) saved with ``save_pretrained``;
* 64 alpaca-style rows and the ``dataset_info.json`` that registers them as ``tiny_alpaca``, with pairwise
  (``tiny_pairs``, ``ranking: true``) and KTO (``tiny_kto``) versions of them for the preference stages, and
  ``tiny_empty_answers`` (every second answer empty: with ``template: empty`` those rows have no labelled token).

Usage: python recipes/tiny_cpu/make_assets.py OUT_DIR [--model-type llama|qwen2] [--tied]
"""

from __future__ import annotations

import argparse
import json
import os
import random

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|pad|>",
]

WORDS = (
    "the a model learns to answer short questions about colors numbers animals and cities "
    "red blue green one two three cat dog bird paris rome tokyo is are what which name count "
    "please tell me list give an example of say hello world yes no because"
).split()


def make_rows(n: int = 64, seed: int = 0, answer_words: tuple[int, int] = (6, 24)) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*answer_words)))
        rows.append({"instruction": f"Question {i}: {q}?", "input": "", "output": a.capitalize() + "."})
    return rows


def make_preference_rows(rows: list[dict], seed: int = 1) -> tuple[list[dict], list[dict]]:
    """Pairwise rows (``tiny_pairs``: the alpaca answer chosen, a shuffled one rejected) and KTO rows
    (``tiny_kto``: every answer tagged desirable or not, alternately)."""
    rng = random.Random(seed)
    pairs, kto = [], []
    for i, row in enumerate(rows):
        words = row["output"].rstrip(".").split()
        rng.shuffle(words)
        rejected = " ".join(words[: max(2, len(words) - rng.randint(0, 3))]).capitalize() + "."
        pairs.append({"instruction": row["instruction"], "input": "", "chosen": row["output"], "rejected": rejected})
        kto.append({"instruction": row["instruction"], "input": "", "output": row["output"] if i % 2 == 0 else rejected,
                    "kto_tag": i % 2 == 0})
    return pairs, kto


def make_tokenizer(texts: list[str], path: str, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
        additional_special_tokens=[t for t in SPECIAL if t not in ("<|begin_of_text|>", "<|eot_id|>", "<|pad|>")],
    )
    fast.save_pretrained(path)
    return fast


def make_model(path: str, tokenizer, model_type: str = "llama", tied: bool = False, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = 384
    assert len(tokenizer) <= vocab, len(tokenizer)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model-type", default="llama")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--answer-words", type=int, nargs=2, default=(6, 24))
    ap.add_argument("--no-model", action="store_true", help="tokenizer and data only")
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
    rows = make_rows(args.rows, answer_words=tuple(args.answer_words))
    with open(os.path.join(args.out, "data", "tiny_alpaca.json"), "w") as f:
        json.dump(rows, f, indent=1)
    pairs, kto = make_preference_rows(rows)
    empty = [dict(r, output="") if i % 2 else r for i, r in enumerate(rows)]  # real data: every second answer empty
    for name, data in (("tiny_pairs.json", pairs), ("tiny_kto.json", kto), ("tiny_empty_answers.json", empty)):
        with open(os.path.join(args.out, "data", name), "w") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(args.out, "data", "dataset_info.json"), "w") as f:
        json.dump({
            "tiny_alpaca": {"file_name": "tiny_alpaca.json"},
            "tiny_empty_answers": {"file_name": "tiny_empty_answers.json"},
            "tiny_pairs": {"file_name": "tiny_pairs.json", "ranking": True, "columns": {
                "prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
            "tiny_kto": {"file_name": "tiny_kto.json", "columns": {
                "prompt": "instruction", "query": "input", "response": "output", "kto_tag": "kto_tag"}},
        }, f, indent=1)
    texts = [r["instruction"] + " " + r["output"] for r in rows[:64]] * 4
    model_dir = os.path.join(args.out, "model")
    tokenizer = make_tokenizer(texts, model_dir)
    if not args.no_model:
        make_model(model_dir, tokenizer, args.model_type, args.tied)
    print(f"assets written to {args.out}")


if __name__ == "__main__":
    main()
