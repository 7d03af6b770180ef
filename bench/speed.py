"""Side-by-side LLaMA-Factory runs on one GPU: tokens/s, peak memory and step losses per scenario (``SCENARIOS``) and
variant, a JSON row per run appended to ``--out``; the 2-layer Llama-3-8B shape (real 128k head), each run
bench/common.py's ``run``. ``--scenarios name:k`` gives a scenario k runs, ``name:k:a/b`` also its variants; odd runs
play the variants reversed. ``--table [--plot]``: medians, ratios and charts.
``--twin S``: the CPU memory twin of ``--layers`` layers at ``--cutoff`` tokens (SFT) or a side (DPO), FSDP2 on one
CPU rank, Triton interpreted; peaks CPU bytes x S^2. Setups and findings: bench/RESULTS.md sections 9 and 12.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import (MODELS, ROOT, TWIN_ENV, VARIANTS, append_row, build, card, card_key, commit, ds_json, dump_json,
                    filling_words, load_rows, now, run, shim, twin_groups, twin_lines, twin_spec, versions)

SPEC = MODELS["llama3-8b"]
KEYS = {"plain": "plain", "liger": "liger", "plugin": "liger_fsdp_auto", "plugin+liger": "liger+liger_fsdp"}
ALL4 = tuple(KEYS)
HEAD_LORA = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
# asset set -> (cutoff_len, answer words, rows); ~1.45 tokens a word with the tiny tokenizer
ASSETS = {"sft": (16384, (300, 500), 400), "2k": (2048, (1500, 1600), 32), "8k": (8192, (6500, 7000), 32)}
SFT_SETUP = "LoRA r16 all + embed_tokens,lm_head, 16k packed tokens a step"
SCENARIOS = {
    "fsdp2_sft": dict(assets="sft", variants=ALL4, ds=None, setup=f"FSDP2, {SFT_SETUP}"),
    "zero2_sft": dict(assets="sft", variants=ALL4, ds=2, setup=f"ZeRO-2, {SFT_SETUP}"),
    "zero3_sft": dict(assets="sft", variants=ALL4, ds=3, setup=f"ZeRO-3 as shipped, {SFT_SETUP}"),
    "zero3_lora_head": dict(assets="sft", variants=("plain", "plugin"), ds=3,
                            cfg=dict(lora_target=HEAD_LORA, additional_target=None),
                            setup="ZeRO-3, LoRA r16 on the 7 projections + lm_head (no additional_target), 16k packed"),
}
PREF = {"dpo": dict(stage="dpo", pref_loss="sigmoid"), "kto": dict(stage="kto", dataset="tiny_kto"),
        "orpo": dict(stage="dpo", pref_loss="orpo"), "simpo": dict(stage="dpo", pref_loss="simpo")}  # tiny_* assets
for _loss, _pcfg in PREF.items():
    for _len in ("2k", "8k"):
        SCENARIOS[f"{_loss}_{_len}"] = dict(
            assets=_len, variants=("plain", "plugin"), ds=None,
            cfg=dict({"dataset": "tiny_pairs", **_pcfg}, pref_beta=0.1, packing=False, learning_rate=1e-6),  # random weights
            setup=f"FSDP2, {_loss.upper()}, LoRA r16 all + embed_tokens,lm_head, LoRA as the reference, answers fill "
                  f"cutoff_len {ASSETS[_len][0]}" + (" (tokens/s: input_ids only, not the KL completions)" * (_loss == "kto")))


def assets(work, key):
    """The model + data directory of one asset set (the same random weights in every set: seed 0)."""
    _, words, rows = ASSETS[key]
    return build(work, "llama3-8b" if key == "sft" else f"llama3-8b_pref{key}", SPEC, 2, rows=rows, answer_words=words,
                 seed=0)


def run_args(work, name, mdir):
    """(cutoff, yaml overrides) of a run of scenario ``name``."""
    sc = SCENARIOS[name]
    cutoff = ASSETS[sc["assets"]][0]
    cfg = {"dataset": "tiny_alpaca", **sc.get("cfg", {})}
    # tokenize once per asset set / stage / dataset / cutoff (LLaMA-Factory saves it there, later runs load it)
    cfg["tokenized_path"] = os.path.join(mdir, f"tokenized_{cfg.get('stage', 'sft')}_{cfg['dataset']}_{cutoff}")
    if sc["ds"]:
        cfg.update(fsdp=None, fsdp_config=None, deepspeed=ds_json(work, sc["ds"]))
    return cutoff, cfg


TWIN_OFFERED = ("plain", "liger_fsdp", "liger_fsdp_fast", "liger_fsdp_auto", "liger_fsdp_noguard")  # interpreted


def twin(args, ap):
    """--twin S: a row per variant of the CPU memory twin, its GPU-sized peaks and what they are made of."""
    s, variants = args.twin, (args.variants or "plain,liger_fsdp,liger_fsdp_fast").split(",")
    if set(variants) - set(TWIN_OFFERED):
        ap.error(f"--variants: {sorted(set(variants) - set(TWIN_OFFERED))} not offered (the interpreter runs "
                 f"{', '.join(TWIN_OFFERED)})")
    out, work = args.out or os.path.join(ROOT, "bench", "results", "cpu_twin.json"), args.work or "/tmp/memory_twin"
    words = filling_words(args.cutoff // s)  # an answer fills a sample (a DPO side; SFT packs them anyway)
    mdir = build(work, f"llama3-8b-L{args.layers}-twin{s}-{args.cutoff}", twin_spec(SPEC, s), args.layers, rows=64,
                 answer_words=(words, words + 50), max_position=max(32768, 2 * args.cutoff), seed=0, device="cpu")
    env = {TWIN_ENV: str(s), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(os.cpu_count()),
           "PYTHONPATH": os.pathsep.join([shim("cpu_fsdp_shim"), os.environ.get("PYTHONPATH", "")])}  # not DDP
    print(f"{'variant':18} {'predicted GiB':>13} {'set-up':>8} {'forward':>8} {'backward':>8} {'optimizer':>9}")
    for variant in variants:
        cfg = dict(lora_rank=max(1, 16 // s), cutoff_len=args.cutoff // s, preprocessing_num_workers=1, use_cpu=True,
                   **(SCENARIOS["dpo_2k"]["cfg"] if args.stage == "dpo" else {}))
        if variant == "liger_fsdp_auto" or (variant != "plain" and "liger_fsdp_backend" not in VARIANTS[variant]):
            cfg["liger_fsdp_backend"] = "triton_fast"  # what auto picks on a GPU
        row = run(mdir, SPEC, variant, args.steps or 3, work, cutoff=args.cutoff // s, overrides=cfg, env=env,
                  tag=f"twin{s}_{args.stage}_L{args.layers}_{args.cutoff}_{variant}", timeout=args.timeout or 1800)
        row.update(twin=s, stage=args.stage, layers=args.layers, cutoff=args.cutoff, card="cpu", date=now(),
                   versions=versions(), commit=commit())
        if "error" not in row:
            for key in [k for k in row if k.endswith("peak_gib")]:
                row[key] *= s**2
            row["live_at_peak"] = twin_groups(row.pop("twin_live", None), s)
            row["live_at_setup"] = twin_groups(row.pop("twin_live_setup", None), s)
            for key in ("tokens_per_s", "tokens_per_s_per_gpu", "step_s", "step_times"):
                row.pop(key, None)  # CPU times say nothing about a GPU
        append_row(out, row)
        if "error" in row:
            print(f"{variant:18} error: {row['error']}")
            continue
        print(f"{variant:18} {row['peak_gib']:>13.2f} {row['setup_peak_gib']:>8.2f} {row['forward_peak_gib']:>8.2f} "
              f"{row['backward_peak_gib']:>8.2f} {row['optimizer_peak_gib']:>9.2f}")
        print("\n".join(twin_lines(row["live_at_peak"], top=8)))
        if row["setup_peak_gib"] > row["peak_gib"]:  # the run's peak is the set-up's: say what it is made of
            print("    at the set-up's peak:\n" + "\n".join(twin_lines(row["live_at_setup"], top=8)))
    print(f"rows appended to {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=None, help="comma list (default: all)")
    ap.add_argument("--variants", default=None, help="comma list (default: each scenario's own)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="default 5")
    ap.add_argument("--out", default=None, help="default bench/results/{card}_speed.json")
    ap.add_argument("--work", default=None, help="default /tmp/real_size")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start; no run starts past it")
    ap.add_argument("--table", action="store_true", help="print the medians of --out's rows; run nothing")
    ap.add_argument("--plot", action="store_true", help="with --table: draw the two charts beside --out")
    ap.add_argument("--twin", type=int, default=0, help="the CPU memory twin at this scale (8: 1/64 of the memory); "
                    "rows to bench/results/cpu_twin.json")
    ap.add_argument("--layers", type=int, default=2, help="--twin: decoder layers")
    ap.add_argument("--cutoff", type=int, default=16384, help="--twin: the GPU run's tokens (the twin runs cutoff / S)")
    ap.add_argument("--stage", choices=["sft", "dpo"], default="sft", help="--twin")
    ap.add_argument("--timeout", type=float, default=None, help="--twin: seconds a run may take (default 1800)")
    args = ap.parse_args()
    if args.twin:
        return twin(args, ap)
    if args.table:
        return table([r for r in load_rows(args.out or os.path.join(ROOT, "bench", "results", "h200_speed.json"))
                      if not r.get("superseded")], args.out if args.plot else None)
    t0 = time.monotonic()
    names = (args.scenarios or ",".join(SCENARIOS)).split(",")
    # "dpo_2k:1": that scenario's number of runs; "zero3_sft:1:plugin/plain": and its variants
    parts = {n.split(":")[0]: n.split(":")[1:] for n in names}
    runs = {n: int(p[0]) if p and p[0] else args.runs for n, p in parts.items()}
    only = {n: set(p[1].split("/")) for n, p in parts.items() if len(p) > 1}
    names = list(runs)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    wanted = (args.variants or ",".join(KEYS)).split(",")
    if set(wanted) - set(KEYS):
        ap.error(f"unknown variant(s) {sorted(set(wanted) - set(KEYS))}; known: {', '.join(KEYS)}")
    steps, work, gpu = args.steps or 5, args.work or "/tmp/real_size", card()
    out = args.out or os.path.join(ROOT, "bench", "results", "{card}_speed.json")
    os.makedirs(work, exist_ok=True)
    out = out.replace("{card}", card_key(gpu))
    existing, vers, session = load_rows(out), versions(), now()
    done, skipped, walls = [], [], []
    for name in names:
        variants = [v for v in SCENARIOS[name]["variants"] if v in only.get(name, wanted)]
        r0 = 1 + max((r["run"] for r in existing if r["scenario"] == name and not r.get("smoke")), default=-1)
        for r in range(r0, r0 + runs[name]):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                mdir = assets(work, SCENARIOS[name]["assets"])
                elapsed = time.monotonic() - t0
                if args.deadline and elapsed + max(walls, default=45) > args.deadline:
                    skipped.append(f"{name}:{variant}:r{r}")
                    continue
                cutoff, cfg = run_args(work, name, mdir)
                timeout = max(30, args.deadline - elapsed) if args.deadline else 900
                start = time.monotonic()
                row = run(mdir, SPEC, KEYS[variant], steps, work, cutoff=cutoff, overrides=cfg,
                          tag=f"{name}_{variant}_r{r}", timeout=timeout)
                walls.append(time.monotonic() - start)
                if args.deadline and str(row.get("error", "")).startswith("timeout"):  # the budget's, not a result
                    skipped.append(f"{name}:{variant}:r{r}(stopped at the deadline)")
                    continue
                row.update(scenario=name, variant=variant, run=r, wall_s=round(walls[-1], 1), date=now(), session=session,
                           card=gpu, versions=vers, steps=steps, cutoff_len=cutoff,
                           setup=SCENARIOS[name]["setup"])
                done.append(row)
                dump_json(out, load_rows(out) + [row])  # a bare list, as the file has always been
                print(f"[speed] {name} {variant} r{r}: rc {row['rc']}, {row.get('tokens_per_s') or 0:.0f} tokens/s, "
                      f"{row.get('peak_gib') or 0:.2f} GiB, {walls[-1]:.0f} s {row.get('error') or ''}", flush=True)
    print(f"\n{len(done)} row(s) appended to {out} ({time.monotonic() - t0:.0f} s); {gpu}; "
          + " ".join(f"{k} {v}" for k, v in vers.items()))
    if skipped:
        print(f"not run (--deadline {args.deadline:.0f} s): {' '.join(skipped)}")
    table([r for r in load_rows(out) if not r.get("smoke") and not r.get("superseded")])


ORDER = ("plain", "liger", "plugin", "plugin+liger", "plugin@persist")  # plugin@persist: rows of a removed scenario
COLORS = {"plain": "#7f7f7f", "liger": "#1f77b4", "plugin": "#d62728", "plugin+liger": "#ff7f0e", "plugin@persist": "#9467bd"}


def table(rows, plot_beside=None):
    """Per card and scenario: each variant's runs, median tokens/s and peak, ratios to plain and Liger; charts."""
    name = lambda r: (r.get("card") or r.get("device") or "?").split(",")[0]  # noqa: E731 (older rows: device)
    for gpu in sorted({name(r) for r in rows}):
        groups = {}
        for r in rows:
            if name(r) == gpu and not r.get("rc"):
                groups.setdefault(r["scenario"], {}).setdefault(r["variant"], []).append(r)
        print(f"\n{gpu}\n| scenario | variant | runs | median tokens/s | median peak GiB | x plain | x liger |")
        print("|---|---|---|---|---|---|---|")
        med = {(s, v): (statistics.median(r["tokens_per_s"] for r in rs), statistics.median(r["peak_gib"] for r in rs))
               for s, vs in groups.items() for v, rs in vs.items()}
        for s, vs in groups.items():
            for v in sorted(vs, key=lambda v: ORDER.index(v) if v in ORDER else len(ORDER)):
                t, p = med[s, v]
                x = [f"{t / med[s, b][0]:.3f}" if (s, b) in med else "-" for b in ("plain", "liger")]
                print(f"| {s} | {v} | {len(vs[v])} | {t:.0f} | {p:.2f} | {x[0]} | {x[1]} |")
        if plot_beside:
            plot(groups, med, gpu, os.path.join(os.path.dirname(os.path.abspath(plot_beside)), card_key(gpu)))


def plot(groups, med, gpu, prefix):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variants = [v for v in ORDER if any(v in vs for vs in groups.values())]
    width = 0.8 / max(len(variants), 1)
    for key, k, label in (("tokens", 0, "tokens/s"), ("memory", 1, "peak GiB allocated")):
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups) + 2), 5))
        for i, (s, vs) in enumerate(groups.items()):
            present = [v for v in variants if v in vs]  # each scenario's own variants, centred on its tick
            for j, v in enumerate(present):
                x = i + (j - (len(present) - 1) / 2) * width
                ax.bar(x, med[s, v][k], width * 0.9, color=COLORS[v])
                vals = [r["tokens_per_s" if k == 0 else "peak_gib"] for r in vs[v]]
                ax.scatter([x] * len(vals), vals, s=12, color="black", zorder=3)
        ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[v]) for v in variants], variants, fontsize=8)
        ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{label} (median bar, one dot per run)")
        ax.set_title(f"{gpu}, 2-layer Llama-3-8B shape, world size 1", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{prefix}_speed_{key}.png", dpi=120)
        plt.close(fig)
    print(f"charts: {prefix}_speed_tokens.png {prefix}_speed_memory.png")


if __name__ == "__main__":
    main()
