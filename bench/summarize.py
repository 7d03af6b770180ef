"""Print the markdown tables of bench/RESULTS.md from the committed JSON (no GPU needed).

    python bench/summarize.py           # the kernel's second round and first checks (from results/archive/), SFT, FSDP
    python bench/summarize.py kernel3   # issue 20's table from results/h200_kernel3.json
    python bench/summarize.py speed [--speed-json bench/results/h200_speed.json] [--png-dir DIR]

``speed``: bench/speed_h200.py's rows -- one table per scenario (median over runs, ratios to plain / liger) and two
PNG charts next to the JSON (or in --png-dir): h200_speed_tokens.png and h200_speed_memory.png.
"""

import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARCHIVE = os.path.join(HERE, "archive")  # superseded runs (bench/RESULTS.md says what replaced each)


def kernel_table():
    """The kernel's second round, run 1 (superseded by the third round's table: ``kernel3``)."""
    rows = json.load(open(os.path.join(ARCHIVE, "h200_kernel2.json")))
    meta = json.load(open(os.path.join(ARCHIVE, "h200_kernel2_meta.json")))
    print(f"Card: {meta['card']}, {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, liger-kernel "
          f"{meta['liger_kernel']}, cut-cross-entropy {meta['cut_cross_entropy']}; bf16 matmul "
          f"{meta['bf16_matmul_tflops']:.0f} TFLOP/s (8192^3, same run).\n")
    print("| N x H x V | impl | ms | floor ms | x floor | peak extra MiB (excl. grads) | incl. grads | err_dx | err_dw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['N']}x{r['H']}x{r['V']} | {r['impl']} | error: {r['error'][:60]} |||||||")
            continue
        print(f"| {r['N']}x{r['H']}x{r['V']} | {r['impl']} | {r['ms']:.1f} | {r['floor_ms']:.1f} | {r['x_floor']:.2f} | "
              f"{r['peak_extra_mib']:.0f} | {r['peak_total_extra_mib']:.0f} | {r['err_dx']:.1e} | {r['err_dw']:.1e} |")


def kernel3_table(path=os.path.join(HERE, "h200_kernel3.json")):
    """Issue 20's table: per shape and ignored fraction, each implementation's ms (x floor_valid_ms, peak MiB beyond
    inputs and gradients) and its dX / dW errors; "x sust." is the same ratio against the sustained matmul rate."""
    rows = [r for r in json.load(open(path)) if "ms" in r]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    keys = list(dict.fromkeys((tuple(r["shape"]), r["ignored_frac"]) for r in rows))
    by = {(tuple(r["shape"]), r["ignored_frac"], r["impl"]): r for r in rows}
    print("| N x H x V | ignored | floor_valid ms | " + " | ".join(f"{i} ms (x, x sust., MiB)" for i in impls)
          + " | err dx / dW: " + ", ".join(impls) + " |")
    print("|---|---|---|" + "---|" * (len(impls) + 1))
    for shape, ign in keys:
        cells, errs, floor = [], [], None
        for i in impls:
            r = by.get((shape, ign, i))
            if r is None:
                cells.append("-")
                errs.append("-")
                continue
            floor = r["floor_valid_ms"] if floor is None else floor  # the first implementation's run
            sust = f", {r['x_valid_floor_sustained']:.2f}" if "x_valid_floor_sustained" in r else ""
            cells.append(f"{r['ms']:.1f} ({r['x_valid_floor']:.2f}{sust}, {r['peak_extra_mib']:.0f})")
            errs.append(f"{r['err_dx']:.1e}/{r['err_dw']:.1e}")
        print(f"| {'x'.join(map(str, shape))} | {ign:.0%} | {floor:.1f} | " + " | ".join(cells) + " | "
              + ", ".join(errs) + " |")


def check_table():
    """The first round's real-size checks (2026-12-02; superseded: results/h200_kernel3_check.json)."""
    data = json.load(open(os.path.join(ARCHIVE, "h200_check.json")))
    print("| backend | N x H x V | dtype | softcap | ignored | err_loss | err_dx | err_dw | torch err_dx / err_dw | deterministic |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in data["checks"]:
        if "err_dx" in r:
            t = f"{r['torch_err_dx']:.1e} / {r['torch_err_dw']:.1e}" if "torch_err_dx" in r else "-"
            print(f"| {r['backend']} | {r['N']}x{r['H']}x{r['V']} | {r['dtype']} | {r['softcap']} | {r['ignore']:.0%} | "
                  f"{r['err_loss']:.1e} | {r['err_dx']:.1e} | {r['err_dw']:.1e} | {t} | {r['deterministic']} |")
        else:
            print(f"| {r['backend']} | {r['N']}x{r['H']}x{r['V']} | {r['dtype']} | {r['softcap']} | 100% | loss {r['loss']} "
                  f"(finite) | grads zero: {r['grads_zero']} | | | {r['deterministic']} |")


def sft_table():
    rows = json.load(open(os.path.join(HERE, "h200_sft.json")))
    print("| model (2 layers, real head) | variant | tokens/s | peak GiB | step ms | losses |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r.get("rc"):
            print(f"| {r['model']} | {r['variant']} | failed: {r.get('error', '')[:60]} ||||")
            continue
        print(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {r['step_s'] * 1e3:.0f} | "
              f"{', '.join(f'{x:g}' for x in r['losses'])} |")


def _bf16_ulp(x):
    import math

    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def fsdp_table(name):
    """bench/multi_gpu_fsdp.py rows: per run tokens/s, peaks, and the curve against the plain run."""
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        return
    rows = json.load(open(path))
    plain = {(r["part"], r["model"], r["fsdp_version"]): r for r in rows if r["label"] == "plain" and not r.get("rc")}
    print("| part | model | run | FSDP | GPUs | tokens/GPU/step | steps | tokens/s/GPU | peak GiB/GPU | fwd+bwd / optimizer peak | loss curve vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("rc"):
            print(f"| {r['part']} | {r['model']} | {r['label']} | {r['fsdp_version']} | {r['nproc']} | | | failed: "
                  f"`{(r.get('error_line') or '')[:90]}` ||||")
            continue
        curve = ""
        ref = plain.get((r["part"], r["model"], r["fsdp_version"]))
        if ref is not None and ref is not r:
            ulps = [abs(a - b) / _bf16_ulp(b) for a, b in zip(r["step_losses"], ref["step_losses"])]
            curve = (f"max rel {r['max_rel_diff_vs_plain']:.1e}; {sum(u == 0 for u in ulps)}/{len(ulps)} steps equal, "
                     f"max {max(ulps):.0f} bf16 ulp")
        peaks = "/".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(f"| {r['part']} | {r['model']} | {r['label']} | {r['fsdp_version']} | {r['nproc']} | {r['tokens_per_gpu_step']} | "
              f"{len(r['step_losses'])} | {r['tokens_per_s_per_gpu']:.0f} | {peaks} | {r['fwd_bwd_peak_gib']:.2f} / "
              f"{r['optimizer_peak_gib']:.2f} | {curve} |")


VARIANT_ORDER = ("plain", "liger", "plugin", "plugin+liger", "plugin@persist")
COLORS = {"plain": "#7f7f7f", "liger": "#1f77b4", "plugin": "#d62728", "plugin+liger": "#ff7f0e",
          "plugin@persist": "#9467bd"}


def _median(xs):
    import statistics

    return statistics.median(xs) if xs else None


def _speed_groups(rows):
    """{scenario: {variant: [rows]}}, scenarios in first-seen order, variants in VARIANT_ORDER."""
    groups = {}
    for r in rows:
        groups.setdefault(r["scenario"], {}).setdefault(r["variant"], []).append(r)
    rank = {v: i for i, v in enumerate(VARIANT_ORDER)}
    return {s: dict(sorted(vs.items(), key=lambda kv: rank.get(kv[0], len(rank)))) for s, vs in groups.items()}


def speed_tables(rows):
    first = rows[0] if rows else {}
    vers = ", ".join(f"{k} {v}" for k, v in (first.get("versions") or {}).items() if v)
    print(f"{len(rows)} run(s); {first.get('device', '?')}; {vers}" + (" (SMOKE: CPU plumbing check)" if first.get("smoke") else ""))
    for scenario, variants in _speed_groups(rows).items():
        ok = {v: [r for r in rs if not r.get("rc")] for v, rs in variants.items()}
        med = {v: _median([r["tokens_per_s"] for r in rs]) for v, rs in ok.items()}
        refs = ["plain", "liger"] if scenario.endswith(("_sft", "_sft_bf16")) or "liger" in variants else ["plain"]
        any_rows = next(iter(variants.values()))
        print(f"\n**{scenario}**: {any_rows[0].get('setup', '')}\n")
        print("| variant | runs (ok/all) | median tokens/s | median peak GiB | " + " | ".join(f"x {ref}" for ref in refs) + " | note |")
        print("|---" * (5 + len(refs)) + "|")
        for v, rs in variants.items():
            if not ok[v]:
                err = next((r.get("error") for r in rs if r.get("error")), "")
                print(f"| {v} | 0/{len(rs)} | - | - | " + " | ".join("-" for _ in refs) + f" | failed: `{(err or '')[:110]}` |")
                continue
            ratios = [f"{med[v] / med[ref]:.3f}" if med.get(ref) else "-" for ref in refs]
            notes = sorted({f"persistence {r['ds_persistence']}" for r in rs if r.get("ds_persistence") not in (None, "auto")}
                           | {"compute-dtype cast" for r in rs if (r.get("env") or {}).get("LF_BENCH_COMPUTE_DTYPE")}
                           | {f"failed: `{(r.get('error') or '')[:80]}`" for r in rs if r.get("rc")})
            print(f"| {v} | {len(ok[v])}/{len(rs)} | {med[v]:.0f} | {_median([r['peak_gib'] for r in ok[v]]):.2f} | "
                  + " | ".join(ratios) + f" | {', '.join(notes)} |")


def speed_charts(rows, png_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _speed_groups(rows)
    variants = [v for v in VARIANT_ORDER if any(v in vs for vs in groups.values())]
    variants += sorted({v for vs in groups.values() for v in vs} - set(variants))
    width = 0.8 / max(len(variants), 1)
    paths = []
    for key, label, name in (("tokens_per_s", "tokens/s (median bar, one dot per run)", "h200_speed_tokens.png"),
                             ("peak_gib", "peak GiB allocated (median bar, one dot per run)", "h200_speed_memory.png")):
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups) + 2), 5))
        for i, vs in enumerate(groups.values()):
            present = [v for v in variants if v in vs]  # each scenario's own variants, centred on its tick
            for j, v in enumerate(present):
                x = i + (j - (len(present) - 1) / 2) * width
                vals = [r[key] for r in vs[v] if not r.get("rc") and r.get(key) is not None]
                if vals:
                    ax.bar(x, _median(vals), width * 0.9, color=COLORS.get(v, "#2ca02c"))
                    ax.scatter([x + width * (k - (len(vals) - 1) / 2) * 0.25 for k in range(len(vals))], vals, s=12,
                               color="black", zorder=3)
                else:  # every run of this variant failed
                    ax.text(x, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=7, color=COLORS.get(v, "k"))
        ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS.get(v, "#2ca02c")) for v in variants], variants, fontsize=8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(list(groups), rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        first = rows[0]
        ax.set_title(("SMOKE (CPU, tiny model)" if first.get("smoke") else f"{first.get('device', '?')}, 2-layer Llama-3-8B shape")
                     + f", world size 1, {first.get('date', '')[:10]}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        paths.append(os.path.join(png_dir, name))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    print("\ncharts: " + ", ".join(paths))


def speed(path, png_dir=None):
    """Rows marked ``superseded`` (a code path since replaced; the reason is in the row) stay in the file, out of
    the tables and charts."""
    rows = [r for r in json.load(open(path)) if not r.get("superseded")]
    speed_tables(rows)
    if rows:
        speed_charts(rows, png_dir or os.path.dirname(os.path.abspath(path)))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Print bench/RESULTS.md's tables from bench/results/ (no GPU needed).")
    ap.add_argument("section", nargs="?", default="all", choices=["all", "speed", "kernel3"],
                    help="all: the tables printed so far (default); speed: bench/speed_h200.py's rows and charts")
    ap.add_argument("--speed-json", default=os.path.join(HERE, "h200_speed.json"))
    ap.add_argument("--png-dir", default=None, help="where the speed charts go (default: next to --speed-json)")
    args = ap.parse_args()
    if args.section == "kernel3":
        kernel3_table()
        raise SystemExit(0)
    if args.section == "speed":
        speed(args.speed_json, args.png_dir)
        raise SystemExit(0)
    kernel_table()
    print()
    check_table()
    print()
    sft_table()
    for name in sorted(os.listdir(HERE)):
        if name.endswith("_fsdp.json"):
            print(f"\n{name}:\n")
            fsdp_table(name)
