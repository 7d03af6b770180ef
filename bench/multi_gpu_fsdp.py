"""The seed's scenario on several GPUs: LLaMA-Factory SFT, LoRA ``lora_target: all`` +
``additional_target: embed_tokens,lm_head``, sharded over ``--nproc`` ranks (bench/common.py's ``run``). Parts:
``repro`` -- Liger's fused loss under FSDP1 (``use_orig_params`` true and false) without the plugin: the original
failure, then the same with ``liger_fsdp: true``, which trains; ``curves`` -- plain loss vs the plugin's, per step,
under FSDP1 and FSDP2; ``heads`` -- the Llama-3-8B and Qwen2.5-7B shapes (real heads) at 16k tokens a GPU.
Rows are merged into ``--out`` (a run replaces its own earlier row). Findings: bench/RESULTS.md section 4.

    python bench/multi_gpu_fsdp.py --nproc 2 --parts repro,curves,heads   # rows to bench/results/{card}x2_fsdp.json
    python bench/multi_gpu_fsdp.py --cpu-smoke --parts repro,curves --out /tmp/smoke.json  # 2 gloo ranks, tiny model
"""

from __future__ import annotations

import argparse
import json
import os

from common import MODELS, ROOT, build, card, card_key, dump_json, load_rows, run, shim, tiny_assets

# Qwen2.5-7B's shape (untied head, vocab 152064) is the "Qwen2.5-shaped model" of the seed report
REPRO_MODEL = "qwen2.5-7b"
HEADS = ("llama3-8b", "qwen2.5-7b")  # the real heads at 16k tokens a GPU
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def cpu_assets(work):
    """A tiny local Qwen2 (recipes/tiny_cpu/make_assets.py), and its spec. Qwen2, not Llama: Liger
    0.8.5 redirects its fused loss through FSDP1 for Llama's head (not for Qwen2's, nor under FSDP2)."""
    return tiny_assets(os.path.join(work, "tiny-qwen2"), "--model-type", "qwen2"), {"layer": "Qwen2DecoderLayer"}


def max_rel(a, b):
    """The largest relative difference of ``a`` to ``b`` over their common steps (None without one)."""
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--parts", default="repro,curves,heads")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "{card}x2_fsdp.json"),
                    help="the rows' JSON ({card}: the card's short name, h200, h100, ...)")
    ap.add_argument("--work", default="/tmp/multi_gpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--curve-steps", type=int, default=20)
    ap.add_argument("--curve-tokens", type=int, default=4096)
    ap.add_argument("--head-steps", type=int, default=6)
    ap.add_argument("--head-tokens", type=int, default=16384)
    ap.add_argument("--fsdp", default="1,2", help="FSDP versions for curves/heads")
    ap.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks on the CPU, the tiny model, tiny steps")
    args = ap.parse_args()
    gpu = "cpu" if args.cpu_smoke else card()
    args.out = args.out.replace("{card}", card_key(gpu))
    os.makedirs(args.work, exist_ok=True)
    parts = args.parts.split(",")
    versions = [int(v) for v in args.fsdp.split(",")]

    env = dict(NCCL_ENV)
    common = {}
    if args.cpu_smoke:
        # the shim lets accelerate shard on CPU ranks; Liger's Triton kernels run interpreted
        env.update(PYTHONPATH=os.pathsep.join(p for p in (shim("cpu_fsdp_shim"), os.environ.get("PYTHONPATH")) if p),
                   OMP_NUM_THREADS="1", TRITON_INTERPRET="1", CPU_FSDP_SHIM_SKIP_SAVE="1", LF_BENCH_LIGER_LOSS_ONLY="1")
        common = dict(use_cpu=True, bf16=False, lora_rank=4, preprocessing_num_workers=1, learning_rate=1e-3,
                      per_device_train_batch_size=2, packing=False)
        repro_model = curve_model = cpu_assets(args.work)
        head_models = [curve_model]
        args.curve_tokens = args.head_tokens = 128
        args.curve_steps, args.head_steps = min(args.curve_steps, 3), min(args.head_steps, 2)
    else:
        repro_model = curve_model = (build(args.work, REPRO_MODEL, MODELS[REPRO_MODEL], args.layers), MODELS[REPRO_MODEL])
        head_models = [(build(args.work, n, MODELS[n], args.layers), MODELS[n]) for n in HEADS] if "heads" in parts else []

    rows = []

    def go(part, model, variant, steps, tokens, fsdp_version, overrides=None, label=None):
        mdir, spec = model
        tag = f"{part}_{os.path.basename(mdir)}_{label or variant}_fsdp{fsdp_version}"
        row = run(mdir, spec, variant, steps, args.work, nproc=args.nproc, fsdp_version=fsdp_version, cutoff=tokens,
                  overrides={**common, **(overrides or {})}, env=env, tag=tag)
        row.update(part=part, label=label or variant, card=gpu)
        if row["rc"]:
            row["error_line"] = row.get("error")  # common.error_line: the worker's exception line
        row.pop("log_tail", None)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "step_losses")}), flush=True)
        return row

    if "repro" in parts:
        for orig in (True, False):
            go("repro", repro_model, "liger", 2, args.curve_tokens, 1, overrides={"fsdp_config": {"use_orig_params": orig}},
               label=f"liger_orig{str(orig).lower()}")
        # the same run with the plugin on: trains (Liger's other kernels stay, its fused loss is bypassed)
        go("repro", repro_model, "liger+liger_fsdp", 2, args.curve_tokens, 1, overrides={"fsdp_config": {"use_orig_params": True}})
    for part, models, steps, tokens in (("curves", [curve_model], args.curve_steps, args.curve_tokens),
                                        ("heads", head_models, args.head_steps, args.head_tokens)):
        if part not in parts:
            continue
        for model in models:
            for version in versions:
                plain = go(part, model, "plain", steps, tokens, version)
                ours = go(part, model, "liger_fsdp_auto", steps, tokens, version, label="liger_fsdp")
                if not plain["rc"] and not ours["rc"]:
                    ours["max_rel_diff_vs_plain"] = max_rel(ours["step_losses"], plain["step_losses"])

    key = lambda r: (r.get("part"), r.get("model"), r.get("label"), r.get("fsdp_version"), r.get("nproc"))  # noqa: E731
    dump_json(args.out, [r for r in load_rows(args.out) if key(r) not in {key(r) for r in rows}] + rows)  # a bare list

    print(f"\n{'part':7s} {'model':12s} {'run':16s} {'fsdp':>4s} {'tok/s':>9s} {'peak GiB/GPU':>14s} {'fwd+bwd/opt':>12s}  note")
    for r in rows:
        peaks = "/".join(f"{p:.2f}" for p in r.get("peak_gib_per_rank") or []) or "-"
        note = r.get("error_line") or ""
        if r.get("max_rel_diff_vs_plain") is not None:
            note = f"loss curve max rel diff vs plain {r['max_rel_diff_vs_plain']:.2e}"
        phases = f"{r.get('fwd_bwd_peak_gib', 0):.2f}/{r.get('optimizer_peak_gib', 0):.2f}"
        print(f"{r['part']:7s} {r['model']:12s} {r['label']:16s} {r['fsdp_version']:4d} {r.get('tokens_per_s', 0):9.0f} {peaks:>14s} {phases:>12s}  {note[:110]}")


if __name__ == "__main__":
    main()
