"""Real-size LLaMA-Factory SFT on one GPU: LoRA + embed_tokens/lm_head, FSDP2 at world size 1, bf16,
16k tokens a step (packing), on models with real heads (Llama-3-8B and Qwen2.5-7B configs reduced to
a few layers, random weights). Variants: plain loss, `liger_fsdp: true`, and Liger
(`enable_liger_kernel: true`, its own fused loss). Reports tokens/s and peak GPU memory. The model build and each
run are bench/common.py's ``build`` and ``run`` (variants: its ``VARIANTS``).

    python bench/real_size_sft.py --out bench/results/h200_sft.json [--layers 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os

from common import MODELS, ROOT, build, run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "h200_sft.json"))
    ap.add_argument("--work", default="/tmp/real_size")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default="plain,liger_fsdp,liger_fsdp_fast,liger")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        mdir = build(args.work, name, MODELS[name], args.layers)
        for variant in args.variants.split(","):
            row = run(mdir, MODELS[name], variant, args.steps, args.work)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'model':12s} {'variant':11s} {'tokens/s':>9s} {'peak GiB':>9s}  note")
    for r in rows:
        note = r.get("error", "")[:70] if r.get("rc") else ""
        print(f"{r['model']:12s} {r['variant']:11s} {r.get('tokens_per_s', 0):9.0f} {r.get('peak_gib', 0):9.2f}  {note}")


if __name__ == "__main__":
    main()
