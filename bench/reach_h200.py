"""One H200, LLaMA-Factory 0.9.5 real-size runs of what the plugin newly reaches (2-layer Llama-3-8B / Qwen2.5-7B
shapes with their real heads, random weights, LoRA r 16 `all` + embed_tokens/lm_head, bf16; bench/common.py's ``run``
does each run through bench/lf_bench_launch.py: tokens/s, peak memory by phase, per-step losses):

* ``zero3``: SFT under DeepSpeed ZeRO-3 at world size 1 (it still partitions), 16k tokens a step:
  ``plain`` as shipped (stops in DeepSpeed's defragment assertion: mixed trainable dtypes), ``plain_bf16`` (no plugin,
  the plugin's dtype policy -- trainable parameters in the compute dtype -- applied by the bench: the unfused
  baseline), ``liger_fsdp`` (the plugin), ``liger`` (Liger's fused loss, same dtype policy, with its
  ``stage3_param_persistence_threshold`` workaround).
* ``dpo``: DPO (sigmoid, LoRA as the reference) under FSDP2 at world size 1, 2 x 8k tokens a step (one pair),
  plain vs ``liger_fsdp``; and SFT ``liger_fsdp`` with the step-1 guard off, for its cost.

    python bench/reach_h200.py zero3|dpo --out bench/results/h200_reach_<part>.json
"""

from __future__ import annotations

import argparse
import json
import os

from common import MODELS, build, ds_json, run


def zero3(work: str, steps: int, models: list[str]) -> list[dict]:
    rows = []
    for name in models:
        mdir = build(work, name, MODELS[name], 2)
        ds = dict(fsdp=None, fsdp_config=None, deepspeed=ds_json(work))
        runs = [("plain", "plain", ds, None), ("plain", "plain_bf16", ds, {"LF_BENCH_COMPUTE_DTYPE": "1"}),
                ("liger_fsdp_auto", "liger_fsdp", ds, None),
                ("liger", "liger_persist", dict(ds, deepspeed=ds_json(work, persistence=1e11)), {"LF_BENCH_COMPUTE_DTYPE": "1"})]
        for variant, label, overrides, env in runs:
            row = run(mdir, MODELS[name], variant, steps, work, overrides=overrides, env=env, tag=f"{name}_z3_{label}")
            row.update(variant=label, sharding="DeepSpeed ZeRO-3")
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
    return rows


def dpo(work: str, steps: int, models: list[str]) -> list[dict]:
    rows = []
    name = models[0]
    mdir = build(os.path.join(work, "dpo"), name, MODELS[name], 2, rows=32, answer_words=(6500, 7000))
    cfg = dict(stage="dpo", dataset="tiny_pairs", pref_beta=0.1, pref_loss="sigmoid", packing=False, cutoff_len=8192,
               learning_rate=1e-6)  # random weights: a small step keeps both runs' curves comparable
    for variant in ("plain", "liger_fsdp_auto"):
        row = run(mdir, MODELS[name], variant, steps, work, cutoff=8192, overrides=cfg, tag=f"{name}_dpo_{variant}")
        row.update(stage="dpo")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
    if os.environ.get("REACH_SKIP_GUARD") == "1":
        return rows
    sft = build(work, name, MODELS[name], 2)
    for variant in ("liger_fsdp_auto", "liger_fsdp_noguard"):  # the guard's cost on step 1
        row = run(sft, MODELS[name], variant, 3, work, tag=f"{name}_guard_{variant}")
        row.update(stage="sft", step_times=row.get("step_times"))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["zero3", "dpo"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/real_size")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    rows = (zero3 if args.part == "zero3" else dpo)(args.work, args.steps, args.models.split(","))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'model':12s} {'variant':20s} {'tok/s':>8s} {'peak GiB':>9s}  losses / error")
    for r in rows:
        tail = r.get("error", "")[:90] if r.get("rc") else " ".join(f"{x:.4f}" for x in (r.get("step_losses") or [])[:5])
        print(f"{r['model']:12s} {r.get('stage', 'sft') + ':' + r['variant']:20s} {r.get('tokens_per_s', 0):8.0f} "
              f"{r.get('peak_gib', 0):9.2f}  {tail}")


if __name__ == "__main__":
    main()
