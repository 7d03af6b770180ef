"""The first-step guard's honest differences and its catch of a 1% error, over every family and head kind (CPU).

For every tiny model of ``llamafactory_liger_fsdp.testing.ALL`` (57 model types), each head kind (modules_to_save,
LoRA on the head, full fine-tuning) and dtype (fp32, bf16, fp16), with logits about 3x larger than the random init
gives (so a softcap bends them): the guard's ``|fused - model| / |model|`` on an honest run, and whether it stops a
run whose fused loss is 1% off. One JSON row per case; a table of the worst honest difference per dtype, against
the bound.

    python bench/guard_bounds.py [--out bench/results/guard_bounds.json] [--names llama,gemma2]

``--cp 1,2,4``: the same under LLaMA-Factory v1's Ulysses sequence parallelism instead, on CPU gloo ranks (one torchrun
of cp ranks a size, ``testing/cpu_ulysses.py``'s stand-ins), through v1's own trainers: SFT and DPO (LoRA + trained
head) and RM (full), fp32 and bf16, a micro-batch of 2 rows short (cut at 127 tokens) and long (about 1,500 tokens a
row, 3,000 a micro-batch: 3x the 1,024 tokens taken as what one rank holds unsplit at this scale, 1/64 of a 65,536-token
rank; cp > 1 only), the 1% error in the plugin's log-probs (RM: its loss). Its rows (``cp`` set) replace those of the same
LLaMA-Factory version; the other rows are kept, and a run without ``--cp`` keeps the CP rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import time

import torch

import common
from common import ROOT
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINE = re.compile(r"model's own loss (\S+), fused loss (\S+) \(")


def one(name: str, head: str, dtype: torch.dtype, inject: float | None) -> dict:
    from llamafactory_liger_fsdp import guard, losses
    from llamafactory_liger_fsdp.config import LigerFsdpConfigError
    from llamafactory_liger_fsdp.engage import engage
    from llamafactory_liger_fsdp.testing import make_inputs, twin

    texts, stopped = [], False
    honest_say, honest_loss = guard.info_rank0, losses.HeadLoss.loss
    guard.info_rank0 = texts.append  # the guard's line (its error carries the same numbers)
    if inject:
        losses.HeadLoss.loss = lambda self, *a, **k: honest_loss(self, *a, **k) * (1 + inject)
    try:
        _, model = twin(name, head)
        with torch.no_grad():
            getattr(model, "get_base_model", lambda: model)().get_output_embeddings().weight.mul_(3.0)
        engage(model.to(dtype), backend="torch")
        try:
            model(**make_inputs(name))
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


CP_DIFF = re.compile(r" (-?[\d.]+(?:e[-+]?\d+)?), (?:with|fused) .*?\|diff\| (\S+), bound ([\d.e+-]+)")
CP_WORDS = {"short": 128, "long": 2048}  # cutoff_len + 1 (the rows are cut at it or end before it)
CP_SHAPE = re.compile(r"\((\d+) (?:pair rows )?x (\d+)\)")


def cp_runs(work: str, size: int, stages: list, dtypes: list) -> list:
    """(row fields, command, v1 args) of every case at cp_size ``size`` (one rank a CP rank, data parallel 1)."""
    from llamafactory_liger_fsdp.integration.v1 import cp_args

    mdir, runs, model = common.tiny_assets(os.path.join(work, "assets")), [], os.path.join(work, "model_kv4")
    if size > 2 and not os.path.exists(os.path.join(model, "model.safetensors")):  # Ulysses over 4: 4 KV heads
        from transformers import AutoConfig, AutoModelForCausalLM

        shutil.copytree(os.path.join(mdir, "model"), model, dirs_exist_ok=True)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model, num_key_value_heads=4)).save_pretrained(model)
    src = json.load(open(os.path.join(mdir, "data", "tiny_pairs.json")))
    for length, tokens in CP_WORDS.items():
        n = tokens // 5  # words a side: ~2 tokens a word, chosen and rejected in one RM / DPO row
        pairs = [{side: [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": " ".join(
            (r[side].split() * n)[:n])}] for side in ("chosen", "rejected")} for r in src[:8]]
        sft = [{"instruction": r["instruction"], "input": "", "output": " ".join((r["chosen"].split() * n)[:2 * n])}
               for r in src[:8]]
        for name, rows, converter in (("pairs", pairs, "pair"), ("sft", sft, "alpaca")):
            path = os.path.join(work, f"{name}_{length}")
            json.dump(rows, open(path + ".json", "w"))
            json.dump({"d": {"path": path + ".json", "source": "local", "converter": converter}}, open(path + ".yaml", "w"))
        for stage in stages:
            for dtype in dtypes:
                for inject in (0.0, 0.01) if size > 1 or (stage != "rm" and length != "long") else ():
                    # (at cp 1: the plugin takes RM under CP only; a long micro-batch needs cp > 1)
                    out = os.path.join(work, f"cp{size}_{stage}_{dtype}_{length}_{inject}")
                    cfg = dict(model=model if size > 2 else os.path.join(mdir, "model"), output_dir=out, micro_batch_size=2,
                               global_batch_size=2, cutoff_len=tokens - 1, max_steps=1, bf16=dtype == "bfloat16",
                               batching_workers=0, learning_rate=1e-3, kernel_config={"name": "liger_fsdp"},
                               train_dataset=os.path.join(work, f"{'sft' if stage == 'sft' else 'pairs'}_{length}.yaml"),
                               **(dict(cp_args.as_yaml(size), flash_attn="flash_attention_2") if size > 1 else
                                  {"dist_config": {"name": "fsdp2"}}))
                    if stage != "rm":
                        cfg["peft_config"] = {"name": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all",
                                              "lora_dropout": 0.0, "modules_to_save": ["lm_head"]}
                    runs.append(({"cp": size, "stage": stage, "dtype": dtype, "length": length, "injected": inject,
                                  "kv_heads": 4 if size > 2 else 2}, stage, cfg))
    return runs


def cp_worker(spec: str) -> None:
    """Under torchrun: every case of ``spec`` one after another in this process (v1's Python API); rank 0 writes the
    rows. The error is injected in :func:`forward.token_logps` (every fused log-prob, the policy's and reference's)
    and in the RM seam's loss; the guard's numbers are read from its line or its stop."""
    import torch.distributed as dist
    from llamafactory.v1.accelerator.interface import DistributedInterface

    from llamafactory_liger_fsdp import forward, guard
    from llamafactory_liger_fsdp.config import LigerFsdpConfigError
    from llamafactory_liger_fsdp.integration.v1 import cp_rm

    cases, rows, said, factor = json.load(open(spec)), [], [], [1.0]
    destroy, DistributedInterface.destroy = DistributedInterface.destroy, lambda self: None  # the last run's is kept
    logps, rm_loss = forward.token_logps, cp_rm.cp_loss
    forward.token_logps = lambda *a, **k: (lambda o: (o[0] * factor[0], *o[1:]))(logps(*a, **k))
    cp_rm.cp_loss = lambda *a, **k: rm_loss(*a, **k) * factor[0]
    guard.info_rank0 = said.append
    for row, command, cfg in cases:
        factor[0], stopped = 1.0 + row["injected"], False
        said.clear()
        module = __import__(f"llamafactory.v1.trainers.{command}_trainer", fromlist=["_"])
        try:
            getattr(module, f"run_{command}")(cfg)
        except LigerFsdpConfigError as exc:
            stopped = True
            said.append(str(exc))
        line = next((t for t in said if "guard" in t), "")
        hit, shape = CP_DIFF.search(line), CP_SHAPE.search(line)
        row.update(stopped=stopped, line=line[:600], tokens=int(shape[1]) * int(shape[2]) if shape else None)
        if hit:
            a, diff, bound = (float(x) for x in hit.groups())
            row.update(diff=diff, bound=bound, rel_diff=diff / abs(a) if a else diff)
        rows.append(row)
    if dist.get_rank() == 0:
        json.dump(rows, open(spec + ".rows", "w"))
    destroy(DistributedInterface())


def cp_main(args) -> None:
    import llamafactory

    work, rows, t0 = os.path.abspath(args.work), [], time.time()
    os.makedirs(work, exist_ok=True)
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [common.shim("cpu_ulysses_shim"), common.shim("cpu_v1_shim"), os.environ.get("PYTHONPATH", "")])}
    for size in map(int, args.cp.split(",")):
        spec = os.path.join(work, f"cp{size}.json")
        with open(spec, "w") as f:
            json.dump(cp_runs(work, size, args.stages.split(","), args.dtypes.split(",")[:2]), f)
        rc, log, _ = common.torchrun(size, [os.path.abspath(__file__), "--cp-worker", spec], env, 3600, spec + ".log")
        if rc or not os.path.exists(spec + ".rows"):
            print(f"cp {size}: rc {rc}, no rows: {common.error_line(log)} (log: {spec}.log)")
            continue
        rows += [dict(r, llamafactory=llamafactory.__version__) for r in json.load(open(spec + ".rows"))]
    done = {(llamafactory.__version__, r["cp"]) for r in rows}
    save(args.out, rows, lambda r: (r.get("llamafactory"), r.get("cp")) not in done,
         {f"cp {llamafactory.__version__}": {"torch": torch.__version__, "seconds": round(time.time() - t0)}})
    print("| LLaMA-Factory | cp | stage | dtype | micro-batch tokens | honest: stopped, |diff| / bound | 1% error stopped |")
    print("|---|---|---|---|---|---|---|")
    for h, e in zip(rows[::2], rows[1::2]):  # each case: honest, then the 1% error
        print(f"| {h['llamafactory']} | {h['cp']} | {h['stage']} | {h['dtype']} | {h['tokens']} | {h['stopped']}, "
              f"{h.get('diff')} / {h.get('bound')} | {e['stopped']} |")


def save(out: str, rows: list, keep, meta: dict) -> None:
    """``rows`` to ``out`` beside its old rows that ``keep`` holds; ``meta`` over its old meta."""
    old = common.load_json(out, {"meta": {}, "rows": []})
    common.dump_json(out, {"meta": {**old["meta"], **meta}, "rows": [r for r in old["rows"] if keep(r)] + rows})


def main():
    from llamafactory_liger_fsdp.testing import ALL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "guard_bounds.json"), help="the rows' JSON")
    ap.add_argument("--names", default=",".join(ALL))
    ap.add_argument("--heads", default="mts,lora,full")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--cp", help="cp sizes, e.g. 1,2,4: the rows under v1's sequence parallelism instead")
    ap.add_argument("--stages", default="sft,rm,dpo", help="with --cp (dpo: a v1 with a DPO trainer)")
    ap.add_argument("--work", default="/tmp/guard_bounds_cp", help="with --cp: assets, yamls, runs, logs")
    ap.add_argument("--cp-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cp_worker:
        return cp_worker(args.cp_worker)
    if args.cp:
        return cp_main(args)
    from llamafactory_liger_fsdp import _log

    _log.logger.setLevel("WARNING")
    rows, t0 = [], time.time()
    for name, head, dtype, inject in itertools.product(args.names.split(","), args.heads.split(","),
                                                       args.dtypes.split(","), (None, 0.01)):
        try:
            rows.append(one(name, head, DTYPES[dtype], inject))
        except Exception as exc:  # a family this head kind or dtype cannot run on the CPU
            rows.append({"name": name, "head": head, "dtype": dtype, "injected": inject or 0.0,
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    save(args.out, rows, lambda r: "cp" in r, {"torch": torch.__version__, "seconds": round(time.time() - t0, 1)})
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
