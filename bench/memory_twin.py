"""The CPU memory twin of a GPU's LLaMA-Factory runs (bench/common.py, "the CPU memory twin"): the peak a GPU run
would reach, by phase, and what it is made of, on this machine's CPU. Rows to ``--out`` (peaks: CPU bytes x s^2).

    python bench/memory_twin.py [--scale 8] [--layers 2] [--cutoff 16384] [--steps 3] [--stage sft|dpo]
                                [--variants plain,liger_fsdp,liger_fsdp_fast] [--out bench/results/cpu_twin.json]

The twin of the Llama-3-8B shape through bench/common.py's ``run``, FSDP2 on one CPU rank (the package's CPU shim),
Triton interpreted; Liger's own kernels do not run under the interpreter. Method and checks: bench/RESULTS.md 12.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from common import (MODELS, ROOT, TWIN_ENV, VARIANTS, append_row, build, commit, filling_words, now,
                    run, shim, twin_groups, twin_lines, twin_spec, versions)

OFFERED = ("plain", "liger_fsdp", "liger_fsdp_fast", "liger_fsdp_auto", "liger_fsdp_noguard")
DPO = dict(stage="dpo", dataset="tiny_pairs", pref_beta=0.1, pref_loss="sigmoid", packing=False, learning_rate=1e-6)


def twin_run(mdir: str, spec: dict, variant: str, args) -> dict:
    s = args.scale
    overrides = {"lora_rank": max(1, 16 // s), "cutoff_len": args.cutoff // s, "preprocessing_num_workers": 1,
                 "use_cpu": True}
    if args.stage == "dpo":
        overrides.update(DPO)
    if variant == "liger_fsdp_auto" or (variant != "plain" and "liger_fsdp_backend" not in VARIANTS[variant]):
        overrides["liger_fsdp_backend"] = "triton_fast"
    env = {TWIN_ENV: str(s), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(os.cpu_count()),
           "PYTHONPATH": os.pathsep.join([shim("cpu_fsdp_shim"), os.environ.get("PYTHONPATH", "")])}  # else DDP on CPU
    row = run(mdir, spec, variant, args.steps, args.work, cutoff=args.cutoff // s, overrides=overrides, env=env,
              tag=f"twin{s}_{args.stage}_L{args.layers}_{args.cutoff}_{variant}", timeout=args.timeout)
    row.update(twin=s, stage=args.stage, layers=args.layers, cutoff=args.cutoff, card="cpu", date=now(),
               versions=versions(), commit=commit())
    if "error" in row:
        return row
    for key in ("peak_gib", "forward_peak_gib", "backward_peak_gib", "optimizer_peak_gib", "fwd_bwd_peak_gib",
                "step1_peak_gib", "setup_peak_gib", "between_peak_gib"):
        row[key] = row.get(key, 0.0) * s**2
    row["live_at_peak"] = twin_groups(row.pop("twin_live", None), s)
    row["live_at_setup"] = twin_groups(row.pop("twin_live_setup", None), s)
    for key in ("tokens_per_s", "tokens_per_s_per_gpu", "step_s", "step_times"):
        row.pop(key, None)  # CPU times say nothing about a GPU
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cutoff", type=int, default=16384, help="the GPU run's tokens (the twin runs cutoff / scale)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stage", choices=["sft", "dpo"], default="sft")
    ap.add_argument("--variants", default="plain,liger_fsdp,liger_fsdp_fast")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_twin.json"), help="the rows' JSON")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "memory_twin"))
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in OFFERED]
    if unknown:
        ap.error(f"--variants: {unknown} not offered (the interpreter runs {', '.join(OFFERED)})")
    os.makedirs(args.work, exist_ok=True)
    spec = twin_spec(MODELS["llama3-8b"], args.scale)
    words = filling_words(args.cutoff // args.scale)  # an answer fills a sample (a DPO side; SFT packs them anyway)
    mdir = build(args.work, f"llama3-8b-L{args.layers}-twin{args.scale}-{args.cutoff}", spec, args.layers, rows=64,
                 answer_words=(words, words + 50), max_position=max(32768, 2 * args.cutoff), seed=0, device="cpu")
    print(f"{'variant':18} {'predicted GiB':>13} {'set-up':>8} {'forward':>8} {'backward':>8} {'optimizer':>9}")
    for variant in variants:
        row = twin_run(mdir, spec, variant, args)
        append_row(args.out, row)
        if "error" in row:
            print(f"{variant:18} error: {row['error']}")
            continue
        print(f"{variant:18} {row['peak_gib']:>13.2f} {row['setup_peak_gib']:>8.2f} {row['forward_peak_gib']:>8.2f} {row['backward_peak_gib']:>8.2f} {row['optimizer_peak_gib']:>9.2f}")
        print("\n".join(twin_lines(row["live_at_peak"], top=8)))
        if row["setup_peak_gib"] > row["peak_gib"]:  # the run's peak is the set-up's: say what it is made of
            print("    at the set-up's peak:\n" + "\n".join(twin_lines(row["live_at_setup"], top=8)))
    print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
