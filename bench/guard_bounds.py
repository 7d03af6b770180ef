"""The first-step guard's honest differences and its catch of a 1% error, over every family and head kind (CPU).

For every tiny model of ``llamafactory_liger_fsdp.testing.ALL`` (57 model types), each head kind (modules_to_save,
LoRA on the head, full fine-tuning) and dtype (fp32, bf16, fp16), with logits about 3x larger than the random init
gives (so a softcap bends them): the guard's ``|fused - model| / |model|`` on an honest run, and whether it stops a
run whose fused loss is 1% off. One JSON row per case; a table of the worst honest difference per dtype, against
the bound.

    python bench/guard_bounds.py [--out bench/results/guard_bounds.json] [--names llama,gemma2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from common import ROOT
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINE = re.compile(r"model's own loss (\S+), fused loss (\S+) \(")


def one(name: str, head: str, dtype: torch.dtype, inject: float | None) -> dict:
    from llamafactory_liger_fsdp import guard, losses
    from llamafactory_liger_fsdp.config import LigerFsdpConfigError
    from llamafactory_liger_fsdp.engage import engage
    from llamafactory_liger_fsdp.testing import make_inputs, twin

    texts = []
    honest_say, honest_loss = guard.info_rank0, losses.HeadLoss.loss
    guard.info_rank0 = texts.append  # the guard's line (its error carries the same numbers)
    if inject:
        losses.HeadLoss.loss = lambda self, *a, **k: honest_loss(self, *a, **k) * (1 + inject)
    try:
        _, model = twin(name, head)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with torch.no_grad():
            base.get_output_embeddings().weight.mul_(3.0)
        model.to(dtype)
        engage(model, backend="torch")
        try:
            model(**make_inputs(name))
            stopped = False
        except LigerFsdpConfigError as exc:
            stopped = True
            texts.append(str(exc))
    finally:
        guard.info_rank0, losses.HeadLoss.loss = honest_say, honest_loss
    row = {"name": name, "head": head, "dtype": str(dtype)[6:], "injected": inject or 0.0, "stopped": stopped}
    hit = LINE.search(texts[0]) if texts else None
    if hit:
        a, f = float(hit.group(1)), float(hit.group(2))
        row.update(model_loss=a, fused_loss=f, rel_diff=abs(f - a) / abs(a), bound_rel=guard.bounds(dtype)[0])
    return row


def main():
    from llamafactory_liger_fsdp.testing import ALL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "guard_bounds.json"), help="the rows' JSON")
    ap.add_argument("--names", default=",".join(ALL))
    ap.add_argument("--heads", default="mts,lora,full")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    args = ap.parse_args()
    from llamafactory_liger_fsdp import _log

    _log.logger.setLevel("WARNING")
    rows, t0 = [], time.time()
    for name in args.names.split(","):
        for head in args.heads.split(","):
            for dtype in args.dtypes.split(","):
                for inject in (None, 0.01):
                    try:
                        row = one(name, head, DTYPES[dtype], inject)
                    except Exception as exc:  # a family this head kind or dtype cannot run on the CPU
                        row = {"name": name, "head": head, "dtype": dtype, "injected": inject or 0.0,
                               "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    rows.append(row)
    meta = {"torch": torch.__version__, "seconds": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| dtype | honest cases | worst rel diff (case) | bound (rel) | 1% injected: stopped / cases | errors |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        honest = [r for r in rows if r["dtype"] == dtype and not r["injected"] and "rel_diff" in r]
        worst = max(honest, key=lambda r: r["rel_diff"], default=None)
        injected = [r for r in rows if r["dtype"] == dtype and r["injected"] and "error" not in r]
        false_alarms = [r for r in honest if r["stopped"]]
        errors = [r for r in rows if r["dtype"] == dtype and "error" in r]
        where = f"{worst['rel_diff']:.2e} ({worst['name']}, {worst['head']})" if worst else "-"
        print(f"| {dtype} | {len(honest)} ({len(false_alarms)} stopped) | {where} | "
              f"{worst['bound_rel'] if worst else '-'} | {sum(r['stopped'] for r in injected)} / {len(injected)} | "
              f"{len(errors)} |")
    for r in rows:
        if "error" in r and not r["injected"]:
            print(f"  not run: {r['name']} {r['head']} {r['dtype']}: {r['error'][:120]}")


if __name__ == "__main__":
    main()
