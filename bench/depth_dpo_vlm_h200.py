"""Issue 28's later parts at real depth on one H200, plain LLaMA-Factory against the plugin, world size 1, FSDP2,
LoRA r16 ``lora_target: all`` + ``additional_target: embed_tokens,lm_head``, bf16, gradient checkpointing:

* ``dpo``: the 32-layer Llama-3-8B shape of bench/depth_h200.py (the same model directory, built once a machine),
  sigmoid DPO, the reference = the adapter disabled, one pair a step with both sides filled to ``cutoff`` tokens
  (--cutoffs 2048,8192: the issue's 2k and 8k a side); packing off.
* ``vlm``: the Qwen2.5-VL-7B shape at its real depth (28 decoder layers, 32-block vision tower, 152k head, random
  weights), a processor built here (a BPE tokenizer trained on the data + Qwen2-VL's image processor), one 448 x 448
  image a sample (256 merged image tokens) and an answer that fills ``cutoff`` (--cutoffs 8192,16384); template
  qwen2_vl, packing off.

Each (cutoff, run) plays plain then plugin on even runs and the reverse on odd ones. A row per run is appended to
--out with bench/depth_h200.py's keys (model, layers, stage, sharding, variant, cutoff, images, fits, tokens_per_s,
peak_gib, step_losses, error, run, date, card) plus the engaged and guard lines, step times and phase peaks; tokens/s
counts every input token of a step (both sides of a pair); with ``LF_BENCH_PROFILE_STEP=N`` in the environment a row
also carries step N's profile (lf_bench_launch.py; that step is slower, so leave it out of timed comparisons). --deadline S: no run starts that would end (by the
longest run so far, or a prior) more than S s after the start. --smoke: the CPU plumbing check (tiny models, fp32,
no FSDP; rows to a temp file unless --out).

    python bench/depth_dpo_vlm_h200.py dpo|vlm [--cutoffs ...] [--runs 2] [--steps 6] [--deadline 540]
                                       [--out bench/results/h200_depth.json] [--work /tmp/real_size] [--smoke]
    python bench/depth_dpo_vlm_h200.py table [--out ...]   # the rows and the targets, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from common import (DEPTH_MODEL, MAKE_ASSETS, MODELS, ROOT, append_row, build_depth_model, card, filling_words,
                    load_rows, log_line, now, rows_for_card, run, versions)

VARIANTS = {"plain": "plain", "plugin": "liger_fsdp_auto"}  # row variant -> bench/common.py's VARIANTS key
WORDS = "the image shows a red blue green square circle cat dog on left right top bottom what color shape is".split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
QWEN25_VL_7B = dict(
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]))
IMAGE_SIDE = 448  # (448 / 14)^2 = 1024 patches, 256 tokens after the 2 x 2 merge
PRIOR_S = {"dpo": 150.0, "vlm": 180.0}  # a run's wall time before one was measured (model load + steps)


# ---------------------------------------------------------------------------------------------------------- assets


def dpo_assets(work: str, cutoff: int, smoke: bool) -> tuple[str, str]:
    """(model dir, data dir): depth's model (smoke: the tiny one) and pairs whose answers fill ``cutoff`` a side."""
    model = os.path.join(work, "smoke") if smoke else build_depth_model(work)
    if smoke and not os.path.exists(os.path.join(model, "model", "config.json")):
        subprocess.run([sys.executable, MAKE_ASSETS, model], check=True, capture_output=True)
    data = os.path.join(work, f"dpo_data_{cutoff}")
    if not os.path.exists(os.path.join(data, "data", "dataset_info.json")):
        words = filling_words(cutoff)
        subprocess.run([sys.executable, MAKE_ASSETS, data, "--no-model", "--rows", "32", "--answer-words", str(words),
                        str(words + 200)], check=True, capture_output=True)
    return model, os.path.join(data, "data")


def _vlm_rows(n: int, words: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [{"messages": [{"role": "user", "content": f"<image>{say(rng.randint(5, 12))}?"},
                          {"role": "assistant", "content": say(words) + "."}],
             "images": [f"images/{i % 4}.png"]} for i in range(n)]


def vlm_assets(work: str, cutoff: int, smoke: bool) -> tuple[str, str]:
    """(model dir, data dir): the Qwen2.5-VL model (smoke: the tiny test config) with its processor, and image rows
    whose answers fill ``cutoff`` (one word a token with this tokenizer)."""
    mdir = os.path.join(work, "qwen2.5-vl-7b" if not smoke else "smoke-vl")
    data = os.path.join(mdir, f"data_{cutoff}")
    if not os.path.exists(os.path.join(data, "dataset_info.json")):
        os.makedirs(os.path.join(data, "images"), exist_ok=True)
        from PIL import Image

        side = IMAGE_SIDE if not smoke else 56
        rng = random.Random(1)
        for i in range(4):  # noise, so the image processor's resize keeps real content
            Image.frombytes("RGB", (side, side), bytes(rng.randrange(256) for _ in range(side * side * 3))).save(
                os.path.join(data, "images", f"{i}.png"))
        with open(os.path.join(data, "tiny_mm.json"), "w") as f:
            json.dump(_vlm_rows(24, cutoff), f)
        with open(os.path.join(data, "dataset_info.json"), "w") as f:
            json.dump({"tiny_mm": {"file_name": "tiny_mm.json", "formatting": "sharegpt",
                                   "columns": {"messages": "messages", "images": "images"},
                                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                            "assistant_tag": "assistant"}}}, f)
    if not os.path.exists(os.path.join(mdir, "model", "config.json")):
        subprocess.run([sys.executable, os.path.abspath(__file__), "build-vlm", mdir] + (["--smoke"] if smoke else []),
                       check=True)  # a process of its own: this one holds no CUDA context
    return mdir, data


def build_vlm(mdir: str, smoke: bool) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (AutoModelForImageTextToText, PreTrainedTokenizerFast, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = [m["content"] for r in _vlm_rows(64, 40) for m in r["messages"]] + ["You are a helpful assistant."]
    tok.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIAL,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    out = os.path.join(mdir, "model")
    side = IMAGE_SIDE if not smoke else 56
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=side * side, max_pixels=side * side),
                        video_processor=Qwen2VLVideoProcessor(), tokenizer=fast,
                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(out)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL}
    if smoke:
        from llamafactory_liger_fsdp.testing import make_config

        config = make_config("qwen2_5_vl")
    else:
        config = CONFIG_MAPPING["qwen2_5_vl"](text_config=QWEN25_VL_7B["text"], vision_config=QWEN25_VL_7B["vision"],
                                              tie_word_embeddings=False)
    config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    config.text_config.eos_token_id, config.text_config.pad_token_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(out)


# ---------------------------------------------------------------------------------------------------------- runs


def overrides(part: str, data: str, cutoff: int, smoke: bool) -> tuple[dict, dict, dict]:
    """(model spec for common.run, yaml overrides, env) of one run."""
    if part == "dpo":
        spec = MODELS["llama3-8b"]
        cfg = dict(stage="dpo", dataset="tiny_pairs", dataset_dir=data, pref_beta=0.1, pref_loss="sigmoid",
                   packing=False, learning_rate=1e-6, tokenized_path=None)  # random weights: a small step
    else:
        spec = dict(MODELS["qwen2.5-7b"], layer="Qwen2_5_VLDecoderLayer")
        side = IMAGE_SIDE if not smoke else 56
        cfg = dict(dataset="tiny_mm", dataset_dir=data, template="qwen2_vl", packing=False,
                   image_max_pixels=side * side, image_min_pixels=side * side, preprocessing_num_workers=1)
    env = {}
    if smoke:  # one CPU process: no FSDP, fp32
        cfg.update(fsdp=None, fsdp_config=None, bf16=None, use_cpu=True, preprocessing_num_workers=None)
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return spec, cfg, env


def one_run(args, meta, mdir, data, cutoff, variant, nrun, timeout):
    spec, cfg, env = overrides(args.part, data, cutoff, args.smoke)
    tag = f"{args.part}_{variant}_{cutoff}_r{nrun}"
    t0 = time.monotonic()
    row = run(mdir, spec, VARIANTS[variant], args.steps, args.work, cutoff=cutoff, overrides=cfg, env=env, tag=tag,
              timeout=timeout)
    wall = time.monotonic() - t0
    log = open(row["log"]).read() if row.get("log") and os.path.exists(row["log"]) else ""
    done = len(row.get("step_times") or [])
    fits = not row.get("rc") and done == args.steps
    model = ("llama3-8b" if args.part == "dpo" else "qwen2.5-vl-7b") if not args.smoke else f"tiny-{args.part}"
    layers = (DEPTH_MODEL["layers"] if args.part == "dpo" else QWEN25_VL_7B["text"]["num_hidden_layers"])
    return dict(model=model, layers=layers if not args.smoke else 2, stage="dpo" if args.part == "dpo" else "sft",
                sharding="fsdp2", variant=variant, cutoff=cutoff, images=1 if args.part == "vlm" else 0, fits=fits,
                tokens_per_s=row.get("tokens_per_s") if fits else None, peak_gib=row.get("peak_gib"),
                step_losses=row.get("step_losses"), error=None if fits else (row.get("error") or f"{done}/{args.steps} steps"),
                run=nrun, date=now(), card=meta["card"], steps=args.steps, step_times=row.get("step_times"),
                step_s=row.get("step_s"), tokens_per_step=row.get("tokens_per_step"), wall_s=round(wall, 1),
                **{f"{p}_peak_gib": row.get(f"{p}_peak_gib") for p in ("setup", "between", "forward", "backward", "optimizer")},
                engaged=row.get("engaged"), guard=log_line(log, "[liger_fsdp] guard"),
                log_tail=None if fits else (row.get("log_tail") or "")[-1500:], versions=meta["versions"],
                plugin_commit=meta["commit"], session=meta["session"], smoke=args.smoke, part=args.part,
                **({"profile": row["profile"]} if row.get("profile") else {}))  # LF_BENCH_PROFILE_STEP=N: step N's ops


def mine(rows, part, smoke):
    """This part's rows, less those marked ``superseded`` (a code path since replaced; the row says by what)."""
    return [r for r in rows if r.get("part") == part and bool(r.get("smoke")) == smoke and not r.get("superseded")]


def card_name(row) -> str:
    """The card's model (``card`` less its memory and driver): rows compare only within one."""
    return (row.get("card") or "?").split(",")[0].replace("NVIDIA ", "")


def table(all_rows, part) -> list[str]:
    """The runs per card, cutoff and variant, and the issue's targets for this part (on each card alone)."""
    out = []
    for card, c in sorted({(card_name(r), r["cutoff"]) for r in all_rows}):
        rows = [r for r in all_rows if card_name(r) == card]
        med = {}
        for v in VARIANTS:
            runs = [r for r in rows if r["cutoff"] == c and r["variant"] == v]
            ok = [r for r in runs if r["fits"]]
            if ok:
                med[v] = (statistics.median(r["tokens_per_s"] for r in ok), statistics.median(r["peak_gib"] for r in ok))
            cells = ", ".join(f"{r['tokens_per_s']:.0f} tok/s @ {r['peak_gib']:.2f} GiB" if r["fits"] else
                              f"fails: {(r['error'] or '')[:100]}" for r in runs)
            first = next((r["step_losses"][0] for r in runs if r.get("step_losses")), None)
            out.append(f"{part} {c} {card}: {v:6s} {cells or '-'}; step-1 loss {first}")
            for r in ok[:1]:
                out.append(f"    {r.get('engaged') or 'not engaged'} | {r.get('guard') or 'no guard line'}")
        if len(med) == 2:
            (tp, mp), (tg, mg) = med["plain"], med["plugin"]
            runs = {v: [r["tokens_per_s"] for r in rows if (r["cutoff"], r["variant"], r["fits"]) == (c, v, True)]
                    for v in VARIANTS}
            spread = ", ".join(f"{v} {len(t)} run(s)" + (f", spread {100 * (max(t) / min(t) - 1):.1f}%" if len(t) > 1 else "")
                               for v, t in runs.items())
            ratio = f"{mg / mp:.3f}x" if mp else "n/a (no CUDA peak)"
            out.append(f"  -> plugin {tg / tp:.3f}x plain tok/s, peak {ratio} plain's ({spread})")
            if part == "dpo":
                out.append(f"     targets: peak <= 0.6x {'met' if mg <= 0.6 * mp and mp else 'NOT met'}; tok/s >= 0.98x "
                           f"{'met' if tg >= 0.98 * tp else 'NOT met'}")
            else:
                guard = all("exact" in (r.get("guard") or "") for r in rows if r["variant"] == "plugin" and r["fits"])
                out.append(f"     targets: trains with images, engaged, guard exact {'met' if guard else 'NOT met'}; "
                           f"peak below plain's {'met' if mg < mp else 'NOT met'}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["dpo", "vlm", "table", "build-vlm"])
    ap.add_argument("mdir", nargs="?", help="build-vlm only: where to build")
    ap.add_argument("--cutoffs", default=None, help="default dpo 2048,8192; vlm 8192,16384 (smoke 128 / 256)")
    ap.add_argument("--variants", default="plain,plugin")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="default 6 (smoke 3)")
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.part == "build-vlm":
        return build_vlm(args.mdir, args.smoke)
    out = args.out or (os.path.join(tempfile.gettempdir(), "h200_depth_dpo_vlm_smoke.json") if args.smoke else
                       os.path.join(ROOT, "bench", "results", "h200_depth.json"))
    if args.part == "table":
        for part in ("dpo", "vlm"):
            print("\n".join(table(mine(load_rows(out), part, args.smoke), part)))
        return
    args.work = args.work or ("/tmp/depth_smoke" if args.smoke else "/tmp/real_size")
    args.steps = args.steps or (3 if args.smoke else 6)
    default = {"dpo": "2048,8192", "vlm": "8192,16384"}[args.part] if not args.smoke else "128,256"
    cutoffs = [int(c) for c in (args.cutoffs or default).split(",")]
    variants = args.variants.split(",")
    os.makedirs(args.work, exist_ok=True)
    commit_file = os.path.join(ROOT, ".whl", "PLUGIN_COMMIT")
    meta = {"card": "cpu (smoke)" if args.smoke else card(), "versions": versions(), "session": now(),
            "commit": open(commit_file).read().strip() if os.path.exists(commit_file) else None}
    out = rows_for_card(out, meta["card"])
    t0, longest, skipped = time.monotonic(), 0.0, []
    for r in range(args.runs):
        for cutoff in cutoffs:
            mdir, data = (dpo_assets if args.part == "dpo" else vlm_assets)(args.work, cutoff, args.smoke)
            for variant in (variants if r % 2 == 0 else variants[::-1]):
                elapsed, guess = time.monotonic() - t0, longest or PRIOR_S[args.part]
                if args.deadline and elapsed + guess > args.deadline:
                    skipped.append(f"{variant}:{cutoff}:r{r + 1}")
                    continue
                timeout = max(30, args.deadline - elapsed) if args.deadline else 3600
                same = [x["run"] for x in load_rows(out) if x.get("part") == args.part  # earlier calls', superseded too
                        and bool(x.get("smoke")) == args.smoke and (x["variant"], x["cutoff"]) == (variant, cutoff)]
                nrun = 1 + max(same, default=0)
                print(f"[{args.part}] {variant} {cutoff} run {nrun} ({elapsed:.0f} s in)", flush=True)
                row = one_run(args, meta, mdir, data, cutoff, variant, nrun, timeout)
                longest = max(longest, row["wall_s"])
                append_row(out, row)
                print(f"[{args.part}] -> {'fits' if row['fits'] else 'fails'}: {row['tokens_per_s'] or 0:.0f} tok/s, "
                      f"{row['peak_gib'] or 0:.2f} GiB, {row['wall_s']:.0f} s; {row['engaged']}; {row['guard']} "
                      f"{'' if row['fits'] else (row['error'] or '')[:300]}", flush=True)
    if skipped:
        print(f"[{args.part}] not run (--deadline): {', '.join(skipped)}")
    print("\n".join(table(mine(load_rows(out), args.part, args.smoke), args.part)))


if __name__ == "__main__":
    main()
