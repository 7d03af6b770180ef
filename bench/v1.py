"""LLaMA-Factory's v1 engine on one GPU: v1's own SFT against the plugin's kernel ``liger_fsdp``, tokens/s and peak
memory, a JSON row per run appended to ``--out`` (``{card}``: the card's short name). The Llama-3-8B shape at
``--layers`` (real 128k head), LoRA r16 on every linear layer + ``modules_to_save`` (the seed's ``[lm_head,
embed_tokens]``; ``-head``: ``[lm_head]``), v1's FSDP2, bf16, checkpointing; each run ``bench/lf_bench_launch.py v1
sft``. ``--cp N``: Ulysses over N ranks. ``--smoke``: CPU plumbing check (tiny model, fp32, gloo). ``--twin S``: the
CPU memory twin (peaks CPU bytes x S^2). Setups and findings: bench/RESULTS.md sections 11, 12 and 14.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import (LAYER_UNITS_ENV, MODELS, ROOT, TWIN_ENV, append_row, build, card, card_key, commit,
                    error_line, filling_words, log_line, now, shim, tiny_assets, twin_groups, twin_lines, twin_spec,
                    torchrun, versions)


HEAD_ONLY = ["lm_head"]
SEED = ["lm_head", "embed_tokens"]
VARIANTS = {  # name -> (kernel_config or None, modules_to_save)
    "plain": (None, SEED), "plain-head": (None, HEAD_ONLY),
    "plugin": ({"name": "liger_fsdp"}, SEED), "plugin-head": ({"name": "liger_fsdp"}, HEAD_ONLY),
    # the lean backend (about 2 GiB less working set at 16k tokens than the default triton_fast)
    "plugin-head-lean": ({"name": "liger_fsdp", "liger_fsdp_backend": "triton"}, HEAD_ONLY),
}


def assets(work: str, smoke: bool, cutoff: int, twin: int = 0, layers: int = 2, keep_heads: bool = False
           ) -> tuple[str, str]:
    """(model dir, v1 dataset yaml): the real-head model with long answers (or its twin, built on the CPU), or the
    tiny CPU assets."""
    if smoke:
        mdir = tiny_assets(os.path.join(work, "tiny"))
    elif twin:
        words = filling_words(cutoff // twin)
        mdir = build(work, f"llama3-8b-{layers}l-{cutoff}-twin{twin}{'-heads' if keep_heads else ''}",
                     twin_spec(MODELS["llama3-8b"], twin, keep_heads), layers, rows=24,
                     answer_words=(words, words + 50), max_position=max(32768, 2 * cutoff), seed=0, device="cpu")
    else:  # answers that fill a sample; one built for a longer cutoff serves (truncated), so no second build
        held = [c for c in (2 * cutoff, 4 * cutoff, 8 * cutoff)
                if os.path.exists(os.path.join(work, f"llama3-8b-{layers}l-{c}", "model", "config.json"))]
        cutoff = held[0] if held else cutoff
        words = filling_words(cutoff)
        mdir = build(work, f"llama3-8b-{layers}l-{cutoff}", MODELS["llama3-8b"], layers, rows=24,
                     answer_words=(words, words + 500), max_position=max(32768, 2 * cutoff))
    data = os.path.join(work, "v1_data.yaml")
    with open(data, "w") as f:
        json.dump({"tiny": {"path": os.path.join(mdir, "data", "tiny_alpaca.json"), "source": "local",
                            "converter": "alpaca"}}, f)
    return os.path.join(mdir, "model"), data


def run(variant: str, model: str, data: str, work: str, args, tag: str) -> dict:
    kernel, mts = VARIANTS[variant]
    out = os.path.join(work, tag)
    s = args.twin or 1
    cfg = dict(model=model, train_dataset=data, output_dir=out, micro_batch_size=args.micro_batch,
               cutoff_len=args.cutoff // s, max_steps=args.steps, learning_rate=1e-4, logging_steps=1,
               batching_workers=0, dist_config={"name": "fsdp2"},
               peft_config={"name": "lora", "r": max(1, 16 // s), "lora_alpha": max(1, 32 // s), "target_modules": "all",
                            "modules_to_save": mts})
    if args.cp > 1:
        from llamafactory_liger_fsdp.integration.v1 import cp_args  # the keys as the installed v1 spells them
        cfg.update(cp_args.as_yaml(args.cp), flash_attn="flash_attention_2")
    if args.offload:  # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer states on the host
        cfg["dist_config"] = dict(cfg["dist_config"], offload_params=True)
    if kernel:
        cfg["kernel_config"] = dict(kernel)
        if args.twin:  # the backend the GPU's auto picks
            cfg["kernel_config"].setdefault("liger_fsdp_backend", "triton_fast")
    if args.smoke:
        cfg.update(bf16=False, enable_activation_checkpointing=False)
    path, result = out + ".yaml", out + ".json"
    json.dump(cfg, open(path, "w"))
    for stale in [result] + [f"{result}.rank{r}" for r in range(1, args.cp)]:
        if os.path.exists(stale):
            os.remove(stale)
    env = dict(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if args.smoke or args.twin:
        shims = [shim("cpu_ulysses_shim")] if args.cp > 1 else []
        env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(shims + [shim("cpu_v1_shim"),
                                                                                os.environ.get("PYTHONPATH", "")]))
    if args.layer_units:
        env[LAYER_UNITS_ENV] = "1"
    if args.twin:
        env.update({TWIN_ENV: str(args.twin), "TRITON_INTERPRET": "1",
                    "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.cp))})
    t0 = time.time()
    rc, log, _ = torchrun(args.cp, [os.path.join(ROOT, "bench", "lf_bench_launch.py"), "v1", "sft", path, result], env,
                          args.timeout, out + ".log")
    row = {"model": os.path.basename(os.path.dirname(model)), "variant": variant, "scenario": "v1_fsdp2_sft",
           "engine": "v1", "modules_to_save": mts, "cutoff_len": args.cutoff, "steps": args.steps,
           "layers": args.layers, "micro_batch_size": args.micro_batch, "cp_size": args.cp,
           "rc": rc, "wall_s": round(time.time() - t0, 1), "engaged": log_line(log, "[liger_fsdp] engaged"),
           "guard": log_line(log, "[liger_fsdp] guard"), "log": out + ".log",
           # v1's FSDP2 made each decoder layer a unit (it logs which), or the whole model one
           "layer_units": True if "Applying per-layer FSDP" in log else False if "Could not identify" in log else None,
           "layer_units_forced": args.layer_units, "offload_params": args.offload}
    if rc != 0 or not os.path.exists(result):
        row.update(fits=False, error=error_line(log) or log[-400:])
        return row
    res = json.load(open(result))
    steps = res["steps"]
    ranks = [res] + [json.load(open(f"{result}.rank{r}")) for r in range(1, args.cp)
                     if os.path.exists(f"{result}.rank{r}")]
    steps_per_rank = [[st["peak_mib"] / 1024 * s**2 for st in r["steps"]] for r in ranks]
    per_rank = [max(peaks) for peaks in steps_per_rank]
    row.update(fits=True, peak_gib=max(per_rank), peak_gib_per_rank=per_rank,  # the steps' peak, each rank's
               step_peaks_gib_per_rank=steps_per_rank,
               setup_peak_gib=steps[0].get("before_peak_mib", 0.0) / 1024 * s**2,  # before step 1
               step_losses=[st["loss"] for st in steps])
    if args.twin:  # predictions: CPU bytes times s^2
        row.update(twin=s, tokens_per_step=steps[-1]["tokens"], cpu_peak_mib=max(st["peak_mib"] for st in steps),
                   twin_constants=res.get("twin_constants"),
                   **{f"{ph}_peak_gib": max(st.get(f"{ph}_peak_mib", 0) for st in steps) / 1024 * s**2
                      for ph in ("forward", "backward", "optimizer")},
                   live_at_peak=twin_groups(res.get("live_at_peak"), s),
                   live_at_setup=twin_groups(res.get("live_at_setup"), s))
        return row
    rates = [st["tokens"] / st["s"] for st in steps[1:] or steps]
    row.update(tokens_per_s=statistics.median(rates), tokens_per_step=steps[-1]["tokens"],
               step_s=statistics.median(st["s"] for st in steps[1:] or steps), step_times=[st["s"] for st in steps])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="plain,plain-head,plugin,plugin-head")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cutoff", type=int, default=16384)
    ap.add_argument("--out", default=None, help="the rows' JSON (default bench/results/{card}_v1.json; --twin: "
                    "cpu_twin_v1.json; --smoke: WORK/smoke.json)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "v1_bench"))
    ap.add_argument("--deadline", type=float, default=540.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--twin", type=int, default=0, help="the CPU memory twin at this scale (8: 1/64 of the memory)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--micro-batch", type=int, default=1, help="rows of --cutoff tokens a step (micro_batch_size)")
    ap.add_argument("--cp", type=int, default=1, help="Ulysses cp_size (that many ranks)")
    ap.add_argument("--layer-units", action="store_true", help="v1's FSDP2 wraps each decoder layer as git main does "
                    "(LLaMA-Factory 0.9.5 makes a PeftModel one unit; with the plugin engaged it does this itself)")
    ap.add_argument("--offload", action="store_true", help="v1 FSDP2's dist_config.offload_params: true")
    ap.add_argument("--keep-heads", action="store_true", help="--twin: keep the head counts, divide the head "
                    "dimension (always so with --cp > 1)")
    args = ap.parse_args()
    if args.smoke:
        args.cutoff, args.steps, args.twin = min(args.cutoff, 128), min(args.steps, 2), 0
    out = args.out or (os.path.join(args.work, "smoke.json") if args.smoke else
                       os.path.join(ROOT, "bench", "results", "cpu_twin_v1.json" if args.twin else "{card}_v1.json"))
    os.makedirs(args.work, exist_ok=True)
    model, data = assets(args.work, args.smoke, args.cutoff, args.twin, args.layers, args.keep_heads or args.cp > 1)
    start, longest = time.time(), 0.0
    variants = args.variants.split(",")
    meta = {"date": now(), "card": "cpu" if args.twin else card(), "versions": versions(), "smoke": args.smoke,
            "commit": commit()}
    out = out.replace("{card}", card_key(meta["card"]))
    print(f"{'run':>3} {'variant':12} {'fits':>5} {'tokens/s':>10} {'peak GiB':>9}  step-1 loss")
    for r in range(args.runs):
        for variant in (variants if r % 2 == 0 else variants[::-1]):
            if time.time() - start + longest > args.deadline:
                print(f"deadline: {variant} run {r} not started")
                continue
            t0 = time.time()
            tag = f"{variant}_{args.cutoff}{'_units' * args.layer_units}{'_offload' * args.offload}_r{r}"
            row = dict(run(variant, model, data, args.work, args, tag), run=r, **meta)
            longest = max(longest, time.time() - t0)
            append_row(out, row)
            loss = row.get("step_losses", [None])[0]
            print(f"{r:>3} {variant:12} {str(row['fits']):>5} {row.get('tokens_per_s', 0):>10.0f} "
                  f"{row.get('peak_gib', 0):>9.2f}  {loss if loss is not None else row.get('error', '')}")
            if row.get("live_at_peak"):  # the twin: the prediction's phases and what it is made of
                print("      phases (GiB): " + ", ".join(f"{ph} {row[f'{ph}_peak_gib']:.2f}"
                                                       for ph in ("forward", "backward", "optimizer")))
                print("\n".join(twin_lines(row["live_at_peak"])))
    print(f"rows appended to {out}")


if __name__ == "__main__":
    main()
