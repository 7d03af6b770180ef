"""Real-size LLaMA-Factory SFT on one GPU: LoRA + embed_tokens/lm_head, FSDP2 at world size 1, bf16,
16k tokens a step (packing), on models with real heads (Llama-3-8B and Qwen2.5-7B configs reduced to
a few layers, random weights). Variants: plain loss, `liger_fsdp: true`, and Liger
(`enable_liger_kernel: true`, its own fused loss). Reports tokens/s and peak GPU memory.

    python bench/real_size_sft.py --out bench/results/h200_sft.json [--layers 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, layer="LlamaDecoderLayer"),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0, layer="Qwen2DecoderLayer"),
}
VARIANTS = {
    "plain": {},
    "liger_fsdp_auto": {"liger_fsdp": True},  # the default backend (auto: triton_fast on CUDA, torch on CPU)
    "liger_fsdp": {"liger_fsdp": True, "liger_fsdp_backend": "triton"},
    "liger_fsdp_fast": {"liger_fsdp": True, "liger_fsdp_backend": "triton_fast"},
    "liger": {"enable_liger_kernel": True},
    "liger+liger_fsdp": {"enable_liger_kernel": True, "liger_fsdp": True},  # Liger's other kernels, our loss
    "liger_fsdp_noguard": {"liger_fsdp": True, "liger_fsdp_guard": False},  # the step-1 guard's cost
}


def build(work, name, spec, layers, rows=400, answer_words=(300, 500)):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    mdir = os.path.join(work, name)
    if os.path.exists(os.path.join(mdir, "model", "config.json")):
        return mdir
    subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "tiny_cpu", "make_assets.py"), mdir, "--no-model",
                    "--rows", str(rows), "--answer-words", *map(str, answer_words)], check=True)
    tok = AutoTokenizer.from_pretrained(os.path.join(mdir, "model"))
    kw = {k: v for k, v in spec.items() if k not in ("model_type", "layer")}
    config = AutoConfig.for_model(spec["model_type"], num_hidden_layers=layers, max_position_embeddings=32768,
                                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **kw)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(os.path.join(mdir, "model"))
    del model
    torch.cuda.empty_cache()
    return mdir


def _line(log, needle):
    """The first log line holding ``needle``, from the needle on (tqdm shares lines with the log)."""
    hit = next((l for l in log.splitlines() if needle in l), None)
    return hit[hit.index(needle):].strip() if hit else None


def error_line(log):
    """The first line naming an exception (not torchrun's ChildFailedError), from a worker's ``[rankN]:`` traceback
    if there is one, with the failing statement when the exception has no message (a bare ``AssertionError``);
    None when there is none."""
    lines = log.splitlines()
    for group in ([l for l in lines if re.match(r"^\[rank\d+\]:", l)], lines):
        group = [re.sub(r"^\[rank\d+\]:\s?", "", l).rstrip() for l in group]
        for i, line in enumerate(group):
            if re.match(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt)\b(:|$)", line) and "ChildFailed" not in line:
                if ":" not in line:  # bare exception: add the statement above it (skipping ^^^ markers)
                    above = [l.strip() for l in group[max(0, i - 4):i] if l.strip() and set(l.strip()) - set("^~ ")]
                    line = f"{line}: {above[-1]}" if above else line
                return line[:400]
    return None


def run(mdir, spec, variant, steps, work, *, nproc=1, fsdp_version=2, cutoff=16384, overrides=None, env=None, tag=None,
        timeout=900, launch=True):
    """One `llamafactory-cli train`-equivalent run (torchrun + bench/lf_bench_launch.py); returns its row.

    ``overrides`` update the yaml (e.g. ``fsdp_config`` keys), ``env`` the environment (a value of
    None removes a variable). A run still going after ``timeout`` s is stopped (SIGTERM: torchrun ends its
    workers) and gives an error row. ``launch=False`` only writes the yaml and returns {"yaml", "config"}."""
    out = os.path.join(work, tag or f"{os.path.basename(mdir)}_{variant}")
    fsdp_config = {"version": fsdp_version, "transformer_layer_cls_to_wrap": spec["layer"]}
    if fsdp_version == 1:
        fsdp_config.update(use_orig_params=True, sync_module_states=False)
    cfg = dict(
        model_name_or_path=os.path.join(mdir, "model"), stage="sft", do_train=True, finetuning_type="lora",
        lora_target="all", lora_rank=16, additional_target="embed_tokens,lm_head", dataset="tiny_alpaca",
        dataset_dir=os.path.join(mdir, "data"), template="llama3", cutoff_len=cutoff, packing=True,
        overwrite_cache=True, preprocessing_num_workers=4, output_dir=out, logging_steps=1, save_strategy="no",
        per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=1e-4, max_steps=steps,
        lr_scheduler_type="constant", bf16=True, include_num_input_tokens_seen=True, report_to="none", seed=0, flash_attn="sdpa",
        fsdp="full_shard auto_wrap", fsdp_config=fsdp_config,
        **VARIANTS[variant],
    )
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    cfg = {k: v for k, v in cfg.items() if v is not None}  # an override of None removes the key
    import yaml

    os.makedirs(out, exist_ok=True)
    path = out + ".yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    if not launch:
        return {"yaml": path, "config": cfg}
    res_path = out + ".json"
    if os.path.exists(res_path):
        os.remove(res_path)
    run_env = dict(os.environ, FSDP_STATE_DICT_TYPE="FULL_STATE_DICT", DISABLE_VERSION_CHECK="1")
    for key, value in (env or {}).items():
        if value is None:
            run_env.pop(key, None)
        else:
            run_env[key] = value
    proc = subprocess.Popen(["torchrun", "--nproc_per_node", str(nproc), os.path.join(ROOT, "bench", "lf_bench_launch.py"),
                             path, res_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.terminate()  # torchrun passes SIGTERM on to its workers (a SIGKILL would leave them running)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    log = stdout + stderr
    with open(out + ".log", "w") as f:
        f.write(log)
    row = {"model": os.path.basename(mdir), "variant": variant, "log": out + ".log", "nproc": nproc, "fsdp_version": fsdp_version,
           "tokens_per_gpu_step": cutoff, "rc": proc.returncode or (0 if os.path.exists(res_path) else 1),
           "engaged": _line(log, "[liger_fsdp] engaged"), "memory_line": _line(log, "[liger_fsdp] memory")}
    if proc.returncode != 0 or not os.path.exists(res_path):
        errs = [l for l in log.splitlines() if "Error" in l or "error:" in l]
        row["error"] = (f"timeout: the run was stopped after {timeout:.0f} s" if timed_out else
                        error_line(log) or (errs[-1] if errs else log[-600:])[:400])
        row["log_tail"] = log[-3000:]
        return row
    res = json.load(open(res_path))
    steps = res["steps"]
    times = [s["s"] for s in steps[1:]] or [s["s"] for s in steps]
    seen = [s["tokens_seen"] for s in steps]
    # tokens_seen counts every rank's tokens
    per_step = (seen[-1] - seen[0]) / max(len(seen) - 1, 1) if seen[-1] else cutoff * nproc
    row.update(step_times=[s["s"] for s in steps], step1_peak_gib=steps[0]["peak_mib"] / 1024,
               tokens_per_step=per_step, step_s=statistics.median(times), tokens_per_s=per_step / statistics.median(times),
               tokens_per_s_per_gpu=per_step / statistics.median(times) / nproc,
               peak_gib=max(s["peak_mib"] for s in res["steps"]) / 1024, losses=res["losses"],
               step_losses=res.get("step_losses"), profile=res.get("profile"), peak_gib_per_rank=[m / 1024 for m in res.get("peak_mib_per_rank", [])],
               **{f"{phase}_peak_gib": max(s.get(f"{phase}_peak_mib", 0) for s in steps) / 1024
                  for phase in ("fwd_bwd", "optimizer", "forward", "backward")})
    return row


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
