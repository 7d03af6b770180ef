"""The CPU memory twin of LLaMA-Factory v1 SFT under Ulysses: each rank's peak on an H200 for the 32-layer Llama-3-8B
shape, v1's own loss (``plain``; ``plain-layers``: each decoder layer a unit) against the plugin's at cp_size
1/2/4/8, one row set per LLaMA-Factory. Each twin run is ``bench/v1.py --twin S --cp N`` (under ``--lock``), kept in
``--runs-out`` (a rerun skips those it holds); the 32-layer peak is extrapolated from two depths (:func:`predict`).
Method, checks and limits: bench/RESULTS.md section 14.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from common import ROOT, commit, dump_json, load_json, load_rows, now, versions

V1 = os.path.join(ROOT, "bench", "v1.py")
# name -> (bench/v1.py variant, modules_to_save [lm_head]; its --layer-units)
VARIANTS = {"plain": ("plain-head", False), "plain-layers": ("plain-head", True), "plugin": ("plugin-head", False)}
LAYERS = 32
H200_GIB = 139.0  # 143771 MiB (140.4 GiB) less the CUDA context and the allocator's slack
MICRO_BATCH = 2
LF = versions()["llamafactory"]  # the LLaMA-Factory this sweep runs (git main reports 0.9.6.dev0)


def key(r: dict) -> tuple:
    return r["cp_size"], r["cutoff_len"] * r["micro_batch_size"], r["layers"], r["variant"]


def held(args, cp: int, tokens: int, depth: int, variant: str) -> list:
    """The twin runs of this point that ``--runs-out`` holds for this LLaMA-Factory (not superseded)."""
    name, forced = VARIANTS[variant]
    return [r for r in load_rows(args.runs_out) if r.get("twin") == args.scale and not r.get("superseded")
            and key(r) == (cp, tokens, depth, name) and bool(r.get("layer_units_forced")) == forced
            and r["versions"]["llamafactory"] == LF]


def measured(args, cp: int, tokens: int, depth: int, variant: str) -> dict:
    """The twin run of this point: the one ``--runs-out`` holds, else a new ``bench/v1.py --twin`` run (under
    ``args.lock``), appended there."""
    rows = held(args, cp, tokens, depth, variant)
    if rows:
        return rows[-1]
    name, forced = VARIANTS[variant]
    cmd = [sys.executable, V1, "--twin", str(args.scale), "--cp", str(cp), "--layers", str(depth), "--cutoff",
           str(tokens // MICRO_BATCH), "--micro-batch", str(MICRO_BATCH), "--steps", str(args.steps), "--runs", "1",
           "--variants", name, "--keep-heads", "--work", args.work, "--out", args.runs_out,
           "--timeout", str(args.timeout), "--deadline", str(10 * args.timeout)] + ["--layer-units"] * forced
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run((["flock", args.lock] if args.lock else []) + cmd, capture_output=True, text=True, env=env)
    print(proc.stdout.strip().splitlines()[-3] if proc.returncode == 0 else proc.stderr[-2000:], flush=True)
    rows = held(args, cp, tokens, depth, variant)
    if not rows:
        raise SystemExit(f"twin run cp {cp}, {tokens} tokens, {depth} layers, {variant} left no row:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return rows[-1]


def increment(r1: dict, r2: dict, layers: int) -> float:
    """The per-layer increment between two twin runs: of their step-1 peaks (the ranks' highest)."""
    first = [max(p[0] for p in r["step_peaks_gib_per_rank"]) for r in (r1, r2)]
    return (first[1] - first[0]) / layers


def cards(paths: str) -> dict:
    """(cp_size, tokens, variant, LLaMA-Factory, layer units) -> (peak GiB, card) of the card rows in ``paths``
    (comma-separated files of bench/v1.py's rows, 32 layers; the first file that has a point gives it; a row from
    before the rows said how v1 wrapped is LLaMA-Factory 0.9.5's whole-model unit)."""
    out = {}
    for r in [r for path in paths.split(",") for r in load_rows(path)]:
        if r.get("layers") == LAYERS and r.get("fits") and not r.get("smoke") and not r.get("offload_params") \
                and r.get("variant") in ("plain-head", "plugin-head"):
            variant = "plugin" if r["variant"] == "plugin-head" else "plain-layers" if r.get("layer_units_forced") \
                else "plain"
            point = (r.get("cp_size", 1), r["cutoff_len"] * r.get("micro_batch_size", 1), variant,
                     r["versions"]["llamafactory"], bool(r.get("layer_units")))
            out.setdefault(point, (r["peak_gib"], r["card"]))
    return out


def predict(args, cp: int, tokens: int, variant: str, d1: int, d2: int) -> dict | None:
    """One row: the 32-layer per-rank prediction of ``variant`` at (cp, tokens); None for ``plain-layers`` where
    v1 plain wraps each layer already. The per-layer increment at cp: v1 plain's at cp 1 with the variant's wrapping
    (one rank, no gloo timing) divided by cp, plus the variant's excess over it at cp 1 whole (with the whole model
    one unit: its gathered copy of a layer, full size a rank)."""
    plain_wraps = measured(args, 1, tokens, d1, "plain").get("layer_units")
    if variant == "plain-layers" and plain_wraps:
        return None
    ref = "plain" if variant == "plain" or plain_wraps else "plain-layers"
    k_ref = increment(*(measured(args, 1, tokens, d, ref) for d in (d1, d2)), d2 - d1)
    k_own = increment(*(measured(args, 1, tokens, d, variant) for d in (d1, d2)), d2 - d1)
    k_cp = k_ref / cp + (k_own - k_ref)
    depths = [d1] if cp > 1 and args.one_depth and tokens >= args.one_depth else [d1, d2]
    runs = [measured(args, cp, tokens, d, variant) for d in depths]
    row = dict(cp_size=cp, tokens=tokens, variant=variant, llamafactory=LF, layer_units=runs[0].get("layer_units"),
               layers=LAYERS, modules_to_save=["lm_head"], micro_batch_size=MICRO_BATCH, twin=args.scale,
               depths=depths, per_layer_gib=k_cp)
    failed = [r for r in runs if not r.get("fits")]
    if failed:
        return dict(row, error=failed[0].get("error"))
    # each rank: from either depth, then their mean (two runs: the ranks' timing moves each a little)
    by_depth = [[q + k_cp * (LAYERS - d) for q in r["peak_gib_per_rank"]] for r, d in zip(runs, depths)]
    per_rank = [sum(qs) / len(qs) for qs in zip(*by_depth)]
    row.update(peak_gib_per_rank=max(per_rank), fits=max(per_rank) <= H200_GIB, card_gib=H200_GIB,
               ranks_gib=per_rank, from_depths_gib=[max(q) for q in by_depth],
               depth_peaks_gib=[r["peak_gib"] for r in runs], engaged=runs[0].get("engaged"),
               guard=runs[0].get("guard"), step_losses=runs[0].get("step_losses"))
    if len(runs) == 2:
        row["measured_per_layer_gib"] = increment(*runs, d2 - d1)
    found = cards(args.cards).get((cp, tokens, variant, LF, bool(row["layer_units"])))
    if found:
        row["measured_peak_gib_per_rank"], row["card"] = found
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--tokens", default="131072,262144", help="tokens a step (2 rows of half each)")
    ap.add_argument("--depths", default="2,4", help="the two depths the twin runs (extrapolated to 32)")
    ap.add_argument("--check-depth", type=int, default=8, help="a third depth at cp 1 (0: none)")
    ap.add_argument("--check-tokens", type=int, default=131072)
    ap.add_argument("--extra", default="1:32768", help="more CP:TOKENS points ('' for none)")
    ap.add_argument("--variants", default="plain,plain-layers,plugin", help="plain-layers: v1 plain with each "
                    "decoder layer a unit (where this LLaMA-Factory's v1 makes the whole model one)")
    ap.add_argument("--one-depth", type=int, default=262144, help="from this many tokens on, cp > 1 runs --depths' "
                    "first only (the cp 1 runs that give the increment still run both; 0: never)")
    ap.add_argument("--check-variants", default="plain")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lock", default=None, help="a flock file each twin run holds (not the sweep)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds a twin run may take")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "twin_cp"))
    ap.add_argument("--runs-out", default=os.path.join(ROOT, "bench", "results", "cpu_twin_cp_runs.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_twin_cp.json"),
                    help="the rows' JSON (this LLaMA-Factory's rows replaced, other versions' kept)")
    ap.add_argument("--cards", default=",".join(os.path.join(ROOT, "bench", "results", f"{c}_v1cp.json")
                                                for c in ("h200", "h100")),
                    help="card rows of bench/v1.py (32 layers) to set beside the predictions (comma-separated)")
    ap.add_argument("--table", action="store_true", help="print the table of --out; run nothing")
    args = ap.parse_args()
    if args.table:
        return print_table(load_rows(args.out))
    os.makedirs(args.work, exist_ok=True)
    d1, d2 = map(int, args.depths.split(","))
    points = [(int(cp), int(t)) for cp in args.cps.split(",") for t in args.tokens.split(",")]
    points += [tuple(map(int, p.split(":"))) for p in args.extra.split(",") if p]
    rows = [row for cp, tokens in points for v in args.variants.split(",")
            if (row := predict(args, cp, tokens, v, d1, d2)) is not None]
    checks = []
    for variant in args.check_variants.split(",") if args.check_depth else ():
        p1, p2, p3 = (measured(args, 1, args.check_tokens, d, variant) for d in (d1, d2, args.check_depth))
        if all(p.get("fits") for p in (p1, p2, p3)):
            predicted = p1["peak_gib"] + increment(p1, p2, d2 - d1) * (args.check_depth - d1)
            checks.append(dict(variant=variant, llamafactory=LF, cp_size=1, tokens=args.check_tokens,
                               depth=args.check_depth, twin_gib=p3["peak_gib"], extrapolated_gib=predicted,
                               residual_gib=predicted - p3["peak_gib"]))
    old = load_json(args.out, {})
    ours = lambda r: r.get("llamafactory") in (None, LF)  # noqa: E731 -- other LLaMA-Factory versions' rows are kept
    meta = old.get("meta", {})
    meta.update(twin=args.scale, depths=[d1, d2], h200_gib=H200_GIB,
                method="bench/twin_cp.py's docstring; bench/RESULTS.md section 14")
    meta.setdefault("runs", {})[LF] = dict(date=now(), commit=commit())
    dump_json(args.out, {"rows": [r for r in old.get("rows", []) if not ours(r)] + rows, "meta": meta,
                         "depth_check": [c for c in old.get("depth_check", []) if not ours(c)] + checks})
    print_table(rows, checks)
    print(f"rows written to {args.out}")


def print_table(rows: list, checks: list = ()) -> None:
    names = ("plain", "plain-layers", "plugin")
    print(f"{'LLaMA-Factory':>13} {'cp':>3} {'tokens':>7} " + " ".join(f"{n:>12}" for n in names) + "  plugin/plain")
    for lf, cp, tokens in sorted({(r["llamafactory"], r["cp_size"], r["tokens"]) for r in rows},
                                 key=lambda p: (p[0], p[2], p[1])):
        got = {r["variant"]: r.get("peak_gib_per_rank") for r in rows
               if (r["llamafactory"], r["cp_size"], r["tokens"]) == (lf, cp, tokens)}
        plain = got.get("plain-layers") or got.get("plain")
        ratio = f"{got['plugin'] / plain:.2f}" if plain and got.get("plugin") else "-"
        print(f"{lf:>13} {cp:>3} {tokens:>7} " + " ".join(f"{got.get(n) or 0:>12.2f}" for n in names) + f"  {ratio}")
    for c in checks:
        print(f"depth check, {c['variant']}, cp 1, {c['tokens']} tokens, {c['depth']} layers: twin {c['twin_gib']:.2f} "
              f"GiB, extrapolated {c['extrapolated_gib']:.2f} GiB (residual {c['residual_gib']:+.2f})")


if __name__ == "__main__":
    main()
