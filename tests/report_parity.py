"""The parity numbers behind the tests, on the CPU (fp32): the engaged model against the unfused one.
A report script of the test suite (not collected by pytest; the tests assert the same bounds).

    python tests/report_parity.py [--out bench/results/cpu_parity.json]

* one process, every supported family x head kind: loss rel diff / max rel diff over every trainable
  gradient (the checks of tests/test_single_parity.py, as numbers);
* 2 gloo ranks, FSDP1 (flat and use_orig_params), FSDP2 and DDP against the unsharded single-process
  unfused reference (tests/fsdp_worker.py, the worker tests/test_dist_parity.py runs): loss, gradients, and the
  parameters after several optimizer steps, the max over both ranks;
* 2 gloo ranks, DeepSpeed ZeRO-0..3 (fp32, offload included) and bf16 under the plugin's dtype policy
  (tests/ds_worker.py, as tests/test_ds_parity.py runs it), with the dtypes the kernel received.
"""

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # this file's own directory: test_dist_parity's case list, support

from support.dist import launch  # noqa: E402


def single():
    from llamafactory_liger_fsdp.engage import engage
    from llamafactory_liger_fsdp.testing import FAMILY_CONFIGS, make_batch, rel, twin

    rows = []
    for family in sorted(FAMILY_CONFIGS):
        for kind in ("mts", "lora", "full"):
            ref, cand = twin(family, kind)
            ref.train(), cand.train()
            engage(cand, backend="torch")
            batch = make_batch()
            out_ref, out = ref(**batch), cand(**batch)
            loss = abs(out.loss.item() - out_ref.loss.item()) / abs(out_ref.loss.item())
            out_ref.loss.backward(), out.loss.backward()
            grad = max(rel(q.grad, p.grad) for (_, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters())
                       if p.requires_grad)
            rows.append({"mode": "single", "case": f"{family}:{kind}", "loss_rel": loss, "grad_rel": grad})
    return rows


def sharded():
    from test_dist_parity import CASES, DDP_CASES, MODES

    rows = []
    for mode in MODES:
        cases = DDP_CASES if mode == "ddp" else CASES
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            proc = launch("fsdp_worker.py", mode, out, *cases, timeout=None)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            ranks = json.load(open(out))
        for case in cases:
            per_rank = [{r["case"]: r for r in rank}[case] for rank in ranks]
            rows.append({"mode": mode, "case": case, "loss_rel": max(r["loss_rel"] for r in per_rank),
                         "grad_rel": max(max(r["grad_rels"].values()) for r in per_rank),
                         "param_rel_after_steps": max(r["param_rels_after"] for r in per_rank)})
    return rows


def deepspeed():
    """2 gloo ranks, DeepSpeed ZeRO-0..3 in fp32 (tests/test_ds_parity.py's cases) and in bf16 under the plugin's
    dtype policy (the kernel's input dtypes recorded), against the unsharded unfused reference."""
    from test_ds_parity import BF16, CASES

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        proc = launch("ds_worker.py", out, *CASES, *BF16, timeout=None, env={"CUDA_VISIBLE_DEVICES": ""})
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        ranks = json.load(open(out))
    for case in CASES + BF16:
        per_rank = [{r["case"]: r for r in rank}[case] for rank in ranks]
        rows.append({"mode": "deepspeed_bf16" if case.endswith(":bf16") else "deepspeed", "case": case,
                     "loss_rel": max(r["loss_rel"] for r in per_rank),
                     "grad_rel": max(max(r["grad_rels"].values()) for r in per_rank),
                     "param_rel_after_steps": max(r["param_rels_after"] for r in per_rank),
                     "kernel_dtypes": sorted({d for r in per_rank for d in r.get("kernel_dtypes", [])})})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_parity.json"))
    args = ap.parse_args()
    rows = single() + sharded() + deepspeed()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("| mode | family:head | loss rel | max grad rel | params rel after steps |")
    print("|---|---|---|---|---|")
    for r in rows:
        after = f"{r['param_rel_after_steps']:.1e}" if "param_rel_after_steps" in r else "-"
        print(f"| {r['mode']} | {r['case']} | {r['loss_rel']:.1e} | {r['grad_rel']:.1e} | {after} |")


if __name__ == "__main__":
    main()
