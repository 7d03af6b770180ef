"""Real-depth LLaMA-Factory runs on one GPU, plain against the plugin, a JSON row per run appended to ``--out``
(``{card}``: the card's short name). Parts: ``sft`` (the Llama-3-8B shape at 32 layers, or ``--model``'s at its real
depth; packing; ``--sharding`` fsdp2, zero3 or zero3-persist), ``dpo`` (the same model, one pair a step filling the
cutoff a side), ``vlm`` (the Qwen2.5-VL-7B shape, one 448 x 448 image a sample); each run bench/common.py's ``run``.
``--search``: per variant, up the ladder (4k ... 128k) while it trains, down while it does not. ``table``: each card's
table and ratios (``--plot``: sft's charts beside --out). Setup and findings: bench/RESULTS.md section 10.

    python bench/depth.py sft --variants plain,liger,plugin,plugin+liger --cutoffs 32768 --search
    python bench/depth.py sft --variants plugin --cutoffs 16384,32768 --sharding zero3 --steps 8
    python bench/depth.py sft --model gemma3-1b --cutoffs 16384 --profile 5 --steps 6   # step 5's torch profile
    python bench/depth.py dpo --cutoffs 2048,8192 --runs 2      # vlm: --cutoffs 8192,16384
    python bench/depth.py table --out bench/results/h100_depth.json --plot
    python bench/depth.py dpo --smoke --runs 1 --cutoffs 128    # CPU plumbing check: tiny models, fp32, no FSDP
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import (DEPTH_LAYERS, MODELS, ROOT, SMOKE_CFG, SMOKE_ENV, append_row, build_depth_model, card, card_key,
                    ds_json, filling_words, load_rows, now, preflight, run, tiny_assets, versions)
from step_profile import profile_line

LADDER = (4096, 8192, 16384, 32768, 65536, 131072)  # the top: build_depth_model's max_position
VARIANTS = {  # row variant -> (bench/common.py's VARIANTS key, extra yaml keys)
    "plain": ("plain", {}), "liger": ("liger", {}), "plugin": ("liger_fsdp_auto", {}),
    "plugin+liger": ("liger+liger_fsdp", {}), "plugin-lean": ("liger_fsdp", {}),
    "plugin-lean+liger": ("liger+liger_fsdp", {"liger_fsdp_backend": "triton"}),
    "plugin-noguard": ("liger_fsdp_noguard", {}),
}
RUN_KEYS = ("peak_gib", "step_losses", "step_times", "step_s", "tokens_per_step", "setup_peak_gib", "between_peak_gib",
            "forward_peak_gib", "backward_peak_gib", "optimizer_peak_gib", "engaged", "guard", "memory_line",
            "liger_line", "cast", "profile", "step_compiles")  # what a row keeps of common.run's
PAIRS = (("plain", "plugin"), ("liger", "plugin+liger"))  # (baseline, ours) compared in the table
DEFAULT_CUTOFFS = {"sft": "32768", "dpo": "2048,8192", "vlm": "8192,16384"}
QWEN25_VL_7B = dict(
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]))
IMAGE_SIDE = {False: 448, True: 56}  # by --smoke; (448 / 14)^2 = 1024 patches, 256 tokens after the 2 x 2 merge


def short(cutoff):
    return f"{cutoff // 1024}k" if cutoff >= 1024 else str(cutoff)


# ---------------------------------------------------------------------------------------------------------- assets
def vlm_assets(work: str, cutoff: int, smoke: bool) -> tuple[str, str]:
    """(model dir, data dir): the Qwen2.5-VL model (smoke: the tiny test config) with its processor
    (llamafactory_liger_fsdp/testing/vlm_assets.py), and image rows whose answers fill ``cutoff``."""
    from llamafactory_liger_fsdp.testing import vlm_assets as assets

    mdir = os.path.join(work, "qwen2.5-vl-7b" if not smoke else "smoke-vl")
    data = os.path.join(mdir, f"data_{cutoff}")
    if not os.path.exists(os.path.join(data, "dataset_info.json")):  # one word a token with this tokenizer
        assets.write_data(data, assets.rows(24, (cutoff, cutoff), (5, 12)), IMAGE_SIDE[smoke], noise=True)
    if not os.path.exists(os.path.join(mdir, "model", "config.json")):
        subprocess.run([sys.executable, os.path.abspath(__file__), "build-vlm", "--work", mdir]
                       + (["--smoke"] if smoke else []), check=True)  # a process of its own: this one holds no CUDA
    return mdir, data


def build_vlm(mdir: str, smoke: bool) -> None:
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from llamafactory_liger_fsdp.testing import make_config, vlm_assets

    side = IMAGE_SIDE[smoke]
    wire = vlm_assets.save_processor(os.path.join(mdir, "model"), vlm_assets.rows(64, (40, 40), (5, 12)),
                                     side * side, side * side, v2_5=True)
    config = make_config("qwen2_5_vl") if smoke else CONFIG_MAPPING["qwen2_5_vl"](
        text_config=QWEN25_VL_7B["text"], vision_config=QWEN25_VL_7B["vision"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = AutoModelForImageTextToText.from_config(wire(config), dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(os.path.join(mdir, "model"))


def setup(args, cutoff: int) -> tuple[str, dict, dict]:
    """(model dir, model spec for common.run, yaml overrides) of one cutoff of this part."""
    if args.part == "vlm":
        mdir, data = vlm_assets(args.work, cutoff, args.smoke)
        side = IMAGE_SIDE[args.smoke]
        return mdir, dict(MODELS["qwen2.5-7b"], layer="Qwen2_5_VLDecoderLayer"), dict(
            dataset="tiny_mm", dataset_dir=data, template="qwen2_vl", packing=False, image_max_pixels=side * side,
            image_min_pixels=side * side, preprocessing_num_workers=1)
    mdir = tiny_assets(os.path.join(args.work, "smoke"), "--rows", 200, "--answer-words", 6, 24) if args.smoke else \
        build_depth_model(args.work, args.model)
    if args.part == "dpo":  # pairs whose answers fill the cutoff a side; random weights: a small step
        words = filling_words(cutoff)
        data = tiny_assets(os.path.join(args.work, f"dpo_data_{cutoff}"), "--no-model", "--rows", 32, "--answer-words",
                           words, words + 200)
        return mdir, MODELS[args.model], dict(stage="dpo", dataset="tiny_pairs", dataset_dir=os.path.join(data, "data"),
                                               pref_beta=0.1, pref_loss="sigmoid", packing=False, learning_rate=1e-6)
    return mdir, MODELS[args.model], {"dataset": "tiny_alpaca",
                                       "tokenized_path": os.path.join(mdir, f"tokenized_sft_{cutoff}")}


# ---------------------------------------------------------------------------------------------------------- runs
def one_run(args, meta, variant, cutoff, nrun, timeout) -> dict | None:
    """One run's row; None when the deadline stopped it."""
    mdir, spec, cfg = setup(args, cutoff)
    key, extra = VARIANTS[variant]
    cfg.update(extra)
    env = {"LF_BENCH_PROFILE": str(args.profile)} if args.profile else {}
    if args.sharding != "fsdp2" and not args.smoke:
        persistence = 1e11 if args.sharding == "zero3-persist" else None
        cfg.update(fsdp=None, fsdp_config=None, deepspeed=ds_json(args.work, persistence=persistence))
    if args.smoke:
        cfg.update(SMOKE_CFG)
        env.update(SMOKE_ENV)
    t0 = time.monotonic()
    row = run(mdir, spec, key, args.steps, args.work, cutoff=cutoff, overrides=cfg, env=env, timeout=timeout,
              tag=f"{args.part}_{args.model}_{args.sharding}_{variant}_{cutoff}_r{nrun}")
    if str(row.get("error", "")).startswith("timeout") and args.deadline:
        return None
    done = len(row.get("step_times") or [])
    fits = not row.get("rc") and done == args.steps
    layers = QWEN25_VL_7B["text"]["num_hidden_layers"] if args.part == "vlm" else DEPTH_LAYERS[args.model]
    out = dict(model=rows_model(args), layers=layers if not args.smoke else 2,
               stage="dpo" if args.part == "dpo" else "sft", sharding=args.sharding, variant=variant, cutoff=cutoff,
               images=int(args.part == "vlm"), fits=fits, tokens_per_s=row.get("tokens_per_s") if fits else None,
               error=None if fits else (row.get("error") or f"{done}/{args.steps} steps"), run=nrun, date=now(),
               steps=args.steps, wall_s=round(time.monotonic() - t0, 1), log_tail=None if fits else row.get("log_tail"),
               smoke=args.smoke, **{k: row.get(k) for k in RUN_KEYS}, **meta)
    if args.part != "sft":
        out["part"] = args.part
    return out


def rows_model(args) -> str:
    """The ``model`` this run's rows carry."""
    return f"tiny-{args.part}" if args.smoke else "qwen2.5-vl-7b" if args.part == "vlm" else args.model


def mine(rows, part, smoke):
    """The current rows of this part (sft rows carry no ``part``), less those marked ``superseded``."""
    return [r for r in rows if r.get("part", "sft") == part and bool(r.get("smoke")) == smoke
            and not r.get("superseded")]


def measure(args, out) -> None:
    t0, variants, skipped = time.monotonic(), args.variants.split(","), []
    cutoffs = [int(c) for c in args.cutoffs.split(",")]
    meta = {"card": "cpu (smoke)" if args.smoke else card(), "versions": versions(), "session": now()}
    commit_file = os.path.join(ROOT, ".whl", "PLUGIN_COMMIT")
    meta["plugin_commit"] = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    out = out.replace("{card}", card_key(meta["card"]))
    print(f"[depth] {meta['card']}; rows to {out}; " + " ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
          flush=True)
    if args.sharding != "fsdp2" and not args.smoke:
        preflight("deepspeed.runtime.zero.stage3")

    def go(variant, cutoff):
        elapsed = time.monotonic() - t0
        if args.deadline and elapsed > args.deadline:
            skipped.append(f"{variant}:{short(cutoff)}")
            return None
        same = [r["run"] for r in load_rows(out) if (r.get("part", "sft"), bool(r.get("smoke")), r["sharding"],
                r["variant"], r["cutoff"], r["model"]) == (args.part, args.smoke, args.sharding, variant, cutoff,
                                                           rows_model(args))]  # superseded too
        print(f"[depth] {args.part} {args.sharding} {variant} {short(cutoff)} x{args.steps} ({elapsed:.0f} s in)",
              flush=True)
        row = one_run(args, meta, variant, cutoff, 1 + max(same, default=0),
                      max(30, args.deadline - elapsed) if args.deadline else 3600)
        if row is None:
            skipped.append(f"{variant}:{short(cutoff)} (stopped at the deadline)")
            return None
        append_row(out, row)
        print(f"[depth] -> {'fits' if row['fits'] else 'does not fit'}: {row['tokens_per_s'] or 0:.0f} tok/s, "
              f"{row['peak_gib'] or 0:.2f} GiB, {row['wall_s']:.0f} s; {row['engaged']}; {row['guard']} "
              f"{'' if row['fits'] else (row['error'] or '')[:300]}", flush=True)
        late = [f"step {i + 1}: " + ", ".join(f"{n} {t}s" for n, t in c)
                for i, c in enumerate(row.get("step_compiles") or []) if i and c]
        if late:  # a Triton compile after step 1 stalls its step
            print(f"[depth]    Triton compiles after step 1: {'; '.join(late)}", flush=True)
        return row

    ladder = sorted({c for c in (LADDER if not args.smoke else (64, 128, 256, 512)) if c <= args.max_cutoff}
                    | {cutoffs[0]})
    for r in range(args.runs):
        order = variants if r % 2 == 0 else variants[::-1]
        for cutoff in [] if args.search else cutoffs:  # each cutoff's variants back to back
            for variant in order:
                go(variant, cutoff)
        for variant in order if args.search else []:
            cutoff, way = cutoffs[0], 0  # up the ladder while it trains, down while it does not
            while cutoff is not None and (row := go(variant, cutoff)) is not None:
                way = way or (1 if row["fits"] else -1)
                if row["fits"] != (way == 1):
                    break
                i = ladder.index(cutoff) + way
                cutoff = ladder[i] if 0 <= i < len(ladder) else None
    print(f"\n[depth] {time.monotonic() - t0:.0f} s; rows in {out}")
    if skipped:
        print(f"[depth] not run (--deadline {args.deadline:.0f} s): " + "; ".join(skipped))
    report(mine(load_rows(out), args.part, args.smoke), args.part)


# ---------------------------------------------------------------------------------------------------------- table
def runs_of(rows, sharding, variant, cutoff=None, fits=None):
    return [r for r in rows if (r["sharding"], r["variant"]) == (sharding, variant)
            and cutoff in (None, r["cutoff"]) and fits in (None, r["fits"])]


def median_of(rows, key, sharding, variant, cutoff):
    vals = [r[key] for r in runs_of(rows, sharding, variant, cutoff, fits=True) if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def longest(rows, sharding, variant):
    return max((r["cutoff"] for r in runs_of(rows, sharding, variant, fits=True)), default=None)


def card_name(row) -> str:
    """The card's model (``card`` less its memory and driver): rows compare only within one."""
    return (row.get("card") or "?").split(",")[0].replace("NVIDIA ", "").strip()


def report(all_rows, part) -> None:
    """Per card and model: runs per (sharding, variant) and cutoff (tokens/s of each run @ median peak GiB), then the
    targets: each variant's longest cutoff, the plugin against its baseline, step-1 losses; the step profiles."""
    for gpu, model in sorted({(card_name(r), r["model"]) for r in all_rows}):
        rows = [r for r in all_rows if (card_name(r), r["model"]) == (gpu, model)]
        keys = sorted({(r["sharding"], r["variant"]) for r in rows}, key=lambda k: (k[0], list(VARIANTS).index(k[1])))
        cuts = sorted({r["cutoff"] for r in rows})
        print(f"\n{part}, {model}, on {gpu}\n| sharding | variant | longest | " + " | ".join(map(short, cuts)) + " |")
        print("|---|---|---|" + "---|" * len(cuts))
        for sharding, variant in keys:
            cells = []
            for c in cuts:
                ok, bad = runs_of(rows, sharding, variant, c, True), runs_of(rows, sharding, variant, c, False)
                oom = any("out of memory" in (r["error"] or "").lower() for r in bad)
                cells.append("/".join(f"{r['tokens_per_s'] / 1e3:.2f}k" for r in ok)
                             + (f" @{median_of(rows, 'peak_gib', sharding, variant, c):.2f}" if ok else "")
                             + ((" +" if ok else "") + ("OOM" if oom else "fails") if bad else "") or "-")
            lc = longest(rows, sharding, variant)
            print(f"| {sharding} | {variant} | {short(lc) if lc else 'none'} | " + " | ".join(cells) + " |")
        print("targets:")
        for line in targets(rows):
            print("  " + line)
        for r in rows:
            if r.get("profile"):
                print(f"  profile {r['variant']} {short(r['cutoff'])} r{r['run']}: {profile_line(r['profile'])}")


def targets(rows) -> list[str]:
    out = []
    for base, ours in PAIRS:
        for sharding in sorted({r["sharding"] for r in rows}):
            common = {r["cutoff"] for r in rows if r["fits"] and r["variant"] == base and r["sharding"] == sharding} & \
                {r["cutoff"] for r in rows if r["fits"] and r["variant"] == ours and r["sharding"] == sharding}
            for c in sorted(common):
                tb, to = (median_of(rows, "tokens_per_s", sharding, v, c) for v in (base, ours))
                pb, po = (median_of(rows, "peak_gib", sharding, v, c) for v in (base, ours))
                n = [len(runs_of(rows, sharding, v, c, True)) for v in (ours, base)]
                out.append(f"{sharding} {short(c)}: {ours} {to / tb:.3f}x {base}'s tokens/s (medians of {n[0]} / "
                           f"{n[1]}), peak {f'{po / pb:.3f}x' if pb else 'n/a'} ({po or 0:.2f} vs {pb or 0:.2f} GiB)")
            lo, lb = longest(rows, sharding, ours), longest(rows, sharding, base)
            if lo and lb:
                out.append(f"{sharding}: longest cutoff {ours} {short(lo)}, {base} {short(lb)}")
    for c in sorted({r["cutoff"] for r in rows if r["sharding"] == "fsdp2"}):
        first = {r["variant"]: r["step_losses"][0] for r in rows
                 if r["sharding"] == "fsdp2" and r["cutoff"] == c and r.get("step_losses") and r["stage"] == "sft"}
        ref = first.get("plain", next(iter(first.values()), None))
        if len(first) > 1 and ref:
            ulp = max(abs(x - ref) / 2.0 ** (math.floor(math.log2(abs(ref))) - 7) for x in first.values())
            out.append(f"step-1 loss at {short(c)}: max {ulp:.2f} bf16 ulp apart over {', '.join(first)}")
    for c in sorted({r["cutoff"] for r in rows if r["sharding"] != "fsdp2"}):
        f = median_of(rows, "tokens_per_s", "fsdp2", "plugin", c)
        for sharding in ("zero3", "zero3-persist"):
            z = median_of(rows, "tokens_per_s", sharding, "plugin", c)
            if z and f:
                out.append(f"plugin {sharding} at {short(c)}: {z / f:.3f}x its FSDP2 tokens/s ({z:.0f} vs {f:.0f})")
    return out


TITLES = {"llama3-8b": "Llama-3-8B", "qwen2.5-0.5b": "Qwen2.5-0.5B", "gemma3-1b": "Gemma 3 1B (text)",
          "qwen3-1.7b": "Qwen3-1.7B"}
COLORS = {"plain": "tab:gray", "liger": "tab:orange", "plugin": "tab:blue", "plugin+liger": "tab:green",
          "plugin-lean": "tab:cyan", "plugin-lean+liger": "tab:olive", "plugin-noguard": "tab:purple"}


def plot(all_rows, out) -> None:
    """sft's charts per card and model beside --out: <card>_depth[_<model>]_longest.png, ..._tokens.png (Llama: none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for gpu, model in sorted({(card_name(r), r["model"]) for r in all_rows}):
        rows = [r for r in all_rows if (card_name(r), r["model"]) == (gpu, model) and r["sharding"] != "zero3-persist"]
        title = f"{TITLES.get(model, model)}, {rows[0]['layers']} layers"
        full = rows[0].get("card") or ""
        mib = full.split(",")[1].split()[0] if full.count(",") >= 1 else ""
        capacity = int(mib) / 1024 if mib.isdigit() else None
        prefix = os.path.join(os.path.dirname(os.path.abspath(out)),
                              f"{card_key(full)}_depth" + ("" if model == "llama3-8b" else f"_{model}"))
        variants = [v for v in VARIANTS if any(r["variant"] == v and r["sharding"] == "fsdp2" for r in rows)]
        ladder = [c for c in LADDER if c >= min(r["cutoff"] for r in rows)]
        searched = [v for v in variants if v != "plugin-noguard"]  # noguard times step 1 at one cutoff
        fig, ax = plt.subplots(figsize=(8, 0.6 * len(searched) + 1.6))
        for i, v in enumerate(searched):
            lc = longest(rows, "fsdp2", v)
            fails = [r["cutoff"] for r in runs_of(rows, "fsdp2", v, fits=False) if lc is None or r["cutoff"] > lc]
            if fails:
                ax.plot(math.log2(min(fails)), i, "rx", markersize=9)
            if lc:
                ax.barh(i, math.log2(lc), color=COLORS[v])
                tps, peak = (median_of(rows, k, "fsdp2", v, lc) for k in ("tokens_per_s", "peak_gib"))
                ax.text(math.log2(max([lc] + fails)) + 0.2, i, f"{short(lc)}: {tps / 1e3:.2f}k tok/s, {peak:.1f} GiB"
                        + (f"; {short(min(fails))} does not fit" if fails else "" if lc >= LADDER[-1] else
                           "; longer not run"), va="center", fontsize=8)
        ax.set_yticks(range(len(searched)), searched)
        ax.set_xticks([math.log2(c) for c in ladder], [short(c) for c in ladder])
        ax.set_xlim(math.log2(ladder[0]) - 0.5, math.log2(ladder[-1]) + 3.2)
        ax.invert_yaxis()
        ax.set_xlabel("longest cutoff_len that trains (x: first that does not)")
        ax.set_title(f"{title}, FSDP2, one {gpu}: longest context", fontsize=10)
        fig.tight_layout()
        fig.savefig(prefix + "_longest.png", dpi=120)
        plt.close(fig)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for v in variants:
            for sharding, style in (("fsdp2", "-o"), ("zero3", "--s")):
                cs = sorted({r["cutoff"] for r in runs_of(rows, sharding, v, fits=True)})
                label = v if sharding == "fsdp2" else f"{v} (ZeRO-3)"
                if cs:
                    a1.plot(cs, [median_of(rows, "tokens_per_s", sharding, v, c) for c in cs], style, color=COLORS[v],
                            label=label)
                    a2.plot(cs, [median_of(rows, "peak_gib", sharding, v, c) for c in cs], style, color=COLORS[v])
            for r in runs_of(rows, "fsdp2", v, fits=False):
                a2.plot(r["cutoff"], capacity or 0, "x", color=COLORS[v], markersize=9)
        for ax in (a1, a2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ladder, [short(c) for c in ladder])
            ax.set_xlabel("cutoff_len (packed tokens a step)")
            ax.grid(alpha=0.3)
        if capacity:
            a2.axhline(capacity, color="k", lw=0.8, ls=":")
            a2.text(ladder[0], capacity * 0.97, f"{gpu} {capacity:.1f} GiB (x: did not fit)", fontsize=8)
        a1.set_ylabel("tokens/s (median of runs; steps 2..n)")
        a2.set_ylabel("peak GiB (max_memory_allocated)")
        a1.legend(fontsize=8)
        fig.suptitle(f"{title}, LoRA r16 all + embed/head copies, bf16, one {gpu}", fontsize=10)
        fig.tight_layout()
        fig.savefig(prefix + "_tokens.png", dpi=120)
        plt.close(fig)
        print(f"charts: {prefix}_longest.png {prefix}_tokens.png")


def plot_small(rows, out, cutoff=16384) -> None:
    """Per card, beside --out: <card>_depth_small.png, the small models' tokens/s and peak GiB at ``cutoff`` (medians)."""
    import matplotlib.pyplot as plt  # (headless, matplotlib picks Agg itself: savefig needs no display)
    for gpu in sorted({card_name(r) for r in rows}):
        at = [r for r in rows if card_name(r) == gpu and r["cutoff"] == cutoff]
        models = [m for m in TITLES if any(r["model"] == m for r in at)]
        variants = [v for v in VARIANTS if any(r["variant"] == v for r in at)]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, key in zip(axes, ("tokens_per_s", "peak_gib")):
            for j, v in enumerate(variants):
                ax.bar([i + (j - len(variants) / 2 + 0.5) * 0.2 for i in range(len(models))], [median_of(
                    [r for r in at if r["model"] == m], key, "fsdp2", v, cutoff) or 0 for m in models], 0.2,
                    color=COLORS[v], label=v)
            ax.set_xticks(range(len(models)), [TITLES[m] for m in models], fontsize=8)
            ax.set_ylabel({"tokens_per_s": "tokens/s (median of steps 2..n)", "peak_gib": "peak GiB"}[key])
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{short(cutoff)} tokens a step, LoRA r16 all + embed/head copies, FSDP2, bf16, one {gpu}")
        fig.tight_layout()
        fig.savefig(os.path.join(os.path.dirname(os.path.abspath(out)), f"{card_key(at[0]['card'])}_depth_small.png"))
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["sft", "dpo", "vlm", "table", "build-vlm"])
    ap.add_argument("--variants", default=None, help="default sft plain,liger,plugin,plugin+liger; dpo / vlm plain,plugin")
    ap.add_argument("--cutoffs", default=None, help="default sft 32768; dpo 2048,8192; vlm 8192,16384 (smoke 128)")
    ap.add_argument("--search", action="store_true", help="sft: the longest cutoff each variant trains, from --cutoffs")
    ap.add_argument("--max-cutoff", type=int, default=LADDER[-1], help="the search's top (default 131072)")
    ap.add_argument("--sharding", choices=["fsdp2", "zero3", "zero3-persist"], default="fsdp2")
    ap.add_argument("--model", choices=list(DEPTH_LAYERS), default="llama3-8b", help="sft / dpo: the model shape")
    ap.add_argument("--profile", type=int, default=0, help="the torch profile of this step of each run (its time "
                    "left out of tokens/s); bench/step_profile.py")
    ap.add_argument("--runs", type=int, default=1, help="runs at each cutoff (order alternating)")
    ap.add_argument("--steps", type=int, default=None, help="default 5 (dpo / vlm 6, smoke 3)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start; no run starts past it")
    ap.add_argument("--out", default=None, help="the rows' JSON (default bench/results/{card}_depth.json, --model "
                    "other than llama3-8b {card}_depth_small.json, as {small} in --out does; smoke: temp)")
    ap.add_argument("--work", default=None, help="default /tmp/real_size (smoke: /tmp/depth_smoke)")
    ap.add_argument("--plot", action="store_true", help="table: also draw sft's charts beside --out")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on tiny local models")
    args = ap.parse_args()
    if args.part == "build-vlm":
        return build_vlm(args.work, args.smoke)
    out = args.out or (os.path.join(tempfile.gettempdir(), "depth_smoke.json") if args.smoke else
                       os.path.join(ROOT, "bench", "results", "{card}_depth{small}.json"))
    out = out.replace("{small}", "_small" * (args.model != "llama3-8b"))  # small models apart: figures read Llama's
    if args.part == "table":
        rows = load_rows(out)
        for part in ("sft", "dpo", "vlm"):
            report(mine(rows, part, args.smoke), part)
        if args.plot:
            for draw in (plot_small, plot) if "_small" in out else (plot,):  # small: also each model's charts
                draw(mine(rows, "sft", args.smoke), out)
        return
    args.variants = args.variants or ("plain,liger,plugin,plugin+liger" if args.part == "sft" else "plain,plugin")
    args.cutoffs = args.cutoffs or ("128" if args.smoke else DEFAULT_CUTOFFS[args.part])
    args.steps = args.steps or (3 if args.smoke else 5 if args.part == "sft" else 6)
    args.max_cutoff = min(args.max_cutoff, 256) if args.smoke else args.max_cutoff
    args.work = args.work or ("/tmp/depth_smoke" if args.smoke else "/tmp/real_size")
    os.makedirs(args.work, exist_ok=True)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: {sorted(unknown)} unknown; known: {', '.join(VARIANTS)}")
    measure(args, out)


if __name__ == "__main__":
    main()
