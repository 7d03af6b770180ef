"""What the bench scripts share (imported as ``common``; no torch at import time): row fields and files, the
package's CPU shims, LLaMA-Factory runs (``run`` -> one row), the CPU memory twin's launch side and tables (``twin_*``).
``python bench/common.py WORK SPEC NAME``: :func:`build_depth_model`'s build, in a process of its own."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE_ASSETS = os.path.join(ROOT, "recipes", "tiny_cpu", "make_assets.py")
DISTS = ("torch", "triton", "transformers", "peft", "accelerate", "deepspeed", "llamafactory", "liger_kernel", "trl",
         "datasets", "llamafactory_liger_fsdp")


# ---------------------------------------------------------------------------------------------------------- row fields
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions(dists=DISTS) -> dict:
    """Each of ``dists``' installed version (None when absent)."""
    from importlib import metadata
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {dist: version(dist) for dist in dists}


def commit() -> str | None:
    """The repository's commit (short), ``-dirty`` when the package has uncommitted changes; None outside git."""
    def git(*argv):
        return subprocess.run(["git", "-C", ROOT, *argv], capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "llamafactory_liger_fsdp")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def card() -> str:
    """The GPU as nvidia-smi names it, with its memory and driver ("cpu" without one); no CUDA context opened."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    return (line or "cpu") + (f", allocator capped at {os.environ[CAP_ENV]} GiB" if os.environ.get(CAP_ENV) else "")


def card_key(name: str) -> str:
    """A card's short name for file names: "NVIDIA H100 80GB HBM3, 81559 MiB, ..." -> "h100"; "cpu ..." -> "cpu"."""
    m = re.search(r"\b([A-Z]\d{2,4})\b", name or "")
    return m.group(1).lower() if m else "cpu" if (name or "cpu").startswith("cpu") else "gpu"


# ---------------------------------------------------------------------------------------------------------- JSON
def dump_json(path: str, obj) -> None:
    """``obj`` to ``path`` (indent 1), through a temporary file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def load_json(path: str, default=None):
    """``path``'s JSON, ``default`` where there is no such file."""
    return json.load(open(path)) if os.path.exists(path) else default


def load_rows(path: str) -> list:
    """The rows of a ``{"rows": [...]}`` file (a bare list is read too); [] when there is none."""
    data = load_json(path, [])
    return data["rows"] if isinstance(data, dict) else data


def append_row(path: str, row: dict) -> None:
    dump_json(path, {"rows": load_rows(path) + [row]})


def shim(name: str) -> str:
    """``llamafactory_liger_fsdp/testing/<name>``, a CPU shim for PYTHONPATH (found without importing the package)."""
    from importlib.util import find_spec
    return os.path.join(list(find_spec("llamafactory_liger_fsdp").submodule_search_locations)[0], "testing", name)


# ---------------------------------------------------------------------------------------------------------- LLaMA-Factory runs
MODELS = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, layer="LlamaDecoderLayer"),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0, layer="Qwen2DecoderLayer"),
    # the small head-heavy models of issue 50 (their real shapes; untied head, as every model here)
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, layer="Qwen2DecoderLayer"),
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                      query_pre_attn_scalar=256, layer="Gemma3DecoderLayer"),  # softcap, norms: transformers' defaults
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                       layer="Qwen3DecoderLayer"),
}
DEPTH_LAYERS = {"llama3-8b": 32, "qwen2.5-0.5b": 24, "gemma3-1b": 26, "qwen3-1.7b": 28}  # each model's real depth
VARIANTS = {
    "plain": {},
    "liger_fsdp_auto": {"liger_fsdp": True},  # the default backend (auto: triton_fast on CUDA, torch on CPU)
    "liger_fsdp": {"liger_fsdp": True, "liger_fsdp_backend": "triton"},
    "liger_fsdp_fast": {"liger_fsdp": True, "liger_fsdp_backend": "triton_fast"},
    "liger": {"enable_liger_kernel": True},
    "liger+liger_fsdp": {"enable_liger_kernel": True, "liger_fsdp": True},  # Liger's other kernels, our loss
    "liger_fsdp_noguard": {"liger_fsdp": True, "liger_fsdp_guard": False},  # the step-1 guard's cost
}
# --smoke runs: one CPU process, no FSDP / DeepSpeed, fp32; Liger's fused loss only, interpreted
SMOKE_CFG = dict(fsdp=None, fsdp_config=None, bf16=None, use_cpu=True, preprocessing_num_workers=None)
SMOKE_ENV = dict(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", LF_BENCH_LIGER_LOSS_ONLY="1",
                 OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
ZERO3 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {"enabled": "auto"},
         "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                               "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": True}}


def tiny_assets(mdir: str, *options) -> str:
    """recipes/tiny_cpu/make_assets.py's assets in ``mdir`` (made once); returns ``mdir``."""
    done = os.path.join(mdir, "data/dataset_info.json" if "--no-model" in options else "model/config.json")
    if not os.path.exists(done):
        subprocess.run([sys.executable, MAKE_ASSETS, mdir, *map(str, options)], check=True, capture_output=True)
    return mdir


def build(work, name, spec, layers, rows=400, answer_words=(300, 500), *, max_position=32768, seed=None,
          device="cuda"):
    """WORK/NAME: make_assets.py's tokenizer and data, and the model of ``spec`` (a ``MODELS`` value or a
    :func:`twin_spec`) at ``layers`` layers, random bf16 weights, untied head, saved once (config.json last, so a
    stopped build is not taken as done)."""
    mdir = os.path.join(work, name)
    if os.path.exists(os.path.join(mdir, "model", "config.json")):
        return mdir
    tiny_assets(mdir, "--no-model", "--rows", rows, "--answer-words", *answer_words)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(mdir, "model"))
    kw = {k: v for k, v in spec.items() if k not in ("model_type", "layer")}
    config = AutoConfig.for_model(spec["model_type"], num_hidden_layers=layers, max_position_embeddings=max_position,
                                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **kw)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = os.path.join(mdir, "model_tmp")
    model.save_pretrained(tmp)
    for fname in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, fname), os.path.join(mdir, "model", fname))
    os.rmdir(tmp)
    del model
    if device == "cuda":  # the cached blocks go back: the runs are other processes
        torch.cuda.empty_cache()
    return mdir


def filling_words(cutoff: int) -> int:
    """Answer words that fill ``cutoff`` tokens with make_assets' tokenizer (~1.45 tokens a word: a little over the
    cutoff, which truncation cuts to it)."""
    return int(cutoff / 1.3)


def _depth_build(work: str, spec: str, name: str) -> str:
    """WORK/NAME: ``MODELS[spec]`` at its real depth (``DEPTH_LAYERS``), positions to 128k, with six 128k packs of data
    (made once: :func:`build` returns at once when it exists)."""
    return build(work, name, MODELS[spec], DEPTH_LAYERS[spec], rows=1400,
                 answer_words=(300, 500), max_position=131072, seed=0)


def build_depth_model(work: str, spec: str = "llama3-8b") -> str:
    """:func:`_depth_build`'s directory, built in a process of its own (the caller then holds no CUDA context: half
    a GiB the runs would lack)."""
    mdir = os.path.join(work, name := f"{spec}-L{DEPTH_LAYERS[spec]}")  # the one place the name is formed
    if not os.path.exists(os.path.join(mdir, "model", "config.json")):
        t0 = time.monotonic()
        subprocess.run([sys.executable, os.path.abspath(__file__), work, spec, name], check=True)
        print(f"[bench] built {mdir} in {time.monotonic() - t0:.0f} s", flush=True)
    return mdir


def preflight(module: str) -> None:
    """Stop in seconds, naming the fix, where ``module`` does not import (not after building the model)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"[bench] cannot import {module}: {last}; carry it in .whl/ (bash bench/make_wheels.sh)")


def ds_json(work: str, stage: int = 3, persistence: float | None = None) -> str:
    """A DeepSpeed json under WORK: ``ZERO3`` (``persistence``: its param persistence threshold), or ZeRO-2 with
    LLaMA-Factory's ds_z2 buckets."""
    config = json.loads(json.dumps(ZERO3))
    if stage == 2:
        config["zero_optimization"] = {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                                       "reduce_scatter": True, "allgather_bucket_size": 500_000_000,
                                       "reduce_bucket_size": 500_000_000}
    elif persistence is not None:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    path = os.path.join(work, "ds_z2.json" if stage == 2 else f"ds_z3_{persistence or 'auto'}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def log_line(log, needle):
    """The first log line holding ``needle``, from the needle on (tqdm shares lines with the log)."""
    hit = next((l for l in log.splitlines() if needle in l), None)
    return hit[hit.index(needle):].strip() if hit else None


def error_line(log):
    """The first line naming an exception (not torchrun's ChildFailedError), a worker's ``[rankN]:`` one first; a bare
    exception with the statement above it."""
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


def torchrun(nproc: int, argv: list, env: dict | None, timeout: float, log_path: str) -> tuple:
    """``torchrun`` on a free port, ``env`` over this environment (None removes a variable), stopped after ``timeout``
    s (SIGTERM: torchrun ends its workers); (returncode, log, timed out), the log also to ``log_path``."""
    env = {k: v for k, v in dict(os.environ, **(env or {})).items() if v is not None}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.Popen(["torchrun", "--nproc_per_node", str(nproc), "--master_port", port, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
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
    with open(log_path, "w") as f:
        f.write(stdout + stderr)
    return proc.returncode, stdout + stderr, timed_out


def run(mdir, spec, variant, steps, work, *, nproc=1, fsdp_version=2, cutoff=16384, overrides=None, env=None, tag=None,
        timeout=900):
    """One `llamafactory-cli train`-equivalent run (bench/lf_bench_launch.py); its row. LoRA r16 ``all`` +
    embed_tokens,lm_head, FSDP ``fsdp_version`` over ``nproc`` ranks, bf16, packing to ``cutoff`` tokens,
    ``VARIANTS[variant]``; ``overrides`` update the yaml (None removes a key), ``env`` the environment."""
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
        lr_scheduler_type="constant", bf16=True, include_num_input_tokens_seen=True, report_to="none", seed=0,
        flash_attn="sdpa", fsdp="full_shard auto_wrap", fsdp_config=fsdp_config, **VARIANTS[variant])
    for key, value in (overrides or {}).items():  # a dict updates a dict; None removes the key
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    import yaml
    os.makedirs(out, exist_ok=True)
    path, res_path = out + ".yaml", out + ".json"
    with open(path, "w") as f:
        yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}, f)
    if os.path.exists(res_path):
        os.remove(res_path)
    env = dict(FSDP_STATE_DICT_TYPE="FULL_STATE_DICT", DISABLE_VERSION_CHECK="1", **(env or {}))
    rc, log, timed_out = torchrun(nproc, [os.path.join(ROOT, "bench", "lf_bench_launch.py"), path, res_path], env,
                                  timeout, out + ".log")
    row = {"model": os.path.basename(mdir), "variant": variant, "log": out + ".log", "nproc": nproc, "fsdp_version": fsdp_version,
           "tokens_per_gpu_step": cutoff, "rc": rc or (0 if os.path.exists(res_path) else 1),
           "engaged": log_line(log, "[liger_fsdp] engaged"), "memory_line": log_line(log, "[liger_fsdp] memory"),
           "guard": log_line(log, "[liger_fsdp] guard"), "liger_line": log_line(log, "Liger kernel has been applied"),
           "cast": log_line(log, "[liger_fsdp] DeepSpeed ZeRO-3: train"),
           "trace_invalidated": log.count("Invalidate trace cache")}
    if rc != 0 or not os.path.exists(res_path):
        errs = [l for l in log.splitlines() if "Error" in l or "error:" in l]
        row["error"] = (f"timeout: the run was stopped after {timeout:.0f} s" if timed_out else
                        error_line(log) or (errs[-1] if errs else log[-600:])[:400])
        row["log_tail"] = log[-3000:].split("torch/distributed/elastic")[0][-1500:]  # the worker's, not torchrun's
        return row
    res = json.load(open(res_path))
    steps = res["steps"]
    times = [s["s"] for s in steps[1:] if not s.get("profiled")] or [s["s"] for s in steps]
    seen = [s["tokens_seen"] for s in steps]
    # tokens_seen counts every rank's tokens
    per_step = (seen[-1] - seen[0]) / max(len(seen) - 1, 1) if seen[-1] else cutoff * nproc
    row.update(step_times=[s["s"] for s in steps], step_compiles=[s.get("compiles", []) for s in steps],
               step1_peak_gib=steps[0]["peak_mib"] / 1024,
               setup_peak_gib=steps[0].get("before_peak_mib", 0.0) / 1024,  # model load, wrapping, optimizer creation
               between_peak_gib=max((s.get("before_peak_mib", 0.0) for s in steps[1:]), default=0.0) / 1024,
               tokens_per_step=per_step, step_s=statistics.median(times), tokens_per_s=per_step / statistics.median(times),
               tokens_per_s_per_gpu=per_step / statistics.median(times) / nproc,
               peak_gib=max(s["peak_mib"] for s in res["steps"]) / 1024, losses=res["losses"],
               step_losses=res.get("step_losses"), twin_live=res.get("live_at_peak"), profile=res.get("profile"),
               twin_live_setup=res.get("live_at_setup"),
               peak_gib_per_rank=[m / 1024 for m in res.get("peak_mib_per_rank", [])],
               **{f"{phase}_peak_gib": max(s.get(f"{phase}_peak_mib", 0) for s in steps) / 1024
                  for phase in ("fwd_bwd", "optimizer", "forward", "backward")})
    return row


def peak_mib(reset: bool = False) -> float:
    """``torch.cuda.max_memory_allocated`` in MiB after a device sync (0 on the CPU); ``reset``: then reset it."""
    import torch
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


class StepClock:
    """A launcher's training step: ``begin()`` keeps the peak since the last step (``before``; at step 1 the set-up),
    resets it and opens the ``## step`` mark (the twin's window); ``end()`` closes it: (seconds, the step's peak)."""

    def begin(self) -> None:
        from torch.autograd.profiler import record_function
        self.before = peak_mib(reset=True)
        self.mark = record_function("## step")
        self.mark.__enter__()
        self.t0 = time.perf_counter()

    def end(self) -> tuple:
        peak = peak_mib()
        self.mark.__exit__(None, None, None)
        return time.perf_counter() - self.t0, peak


# ---------------------------------------------------------------------------------------------- the CPU memory twin
# A run with tokens, hidden, intermediate, vocab and LoRA rank divided by s allocates 1/s^2 of the GPU run's memory,
# op for op; on the CPU every allocation can be seen, so its peak x s^2 predicts the GPU's (bench/RESULTS.md 12).
# Here: the launch side and tables; in the training process: llamafactory_liger_fsdp/testing/memory_twin.py.
TWIN_ENV = "LF_BENCH_TWIN"  # the twin's s, in a launched run's environment
CAP_ENV = "LF_BENCH_CARD_GIB"  # a launched run's allocator held to this many GiB (an 80 GB card's on a larger one)
LAYER_UNITS_ENV = "LF_BENCH_LAYER_UNITS"  # "1": a launched v1 run wraps each decoder layer (bench/lf_bench_launch.py v1)


def twin_spec(spec: dict, s: int, keep_heads: bool = False) -> dict:
    """``spec`` with hidden, intermediate, vocabulary and head counts divided by ``s`` (the head dimension stays);
    ``keep_heads``: the head counts stay and the head dimension is divided (Ulysses splits heads over CP ranks)."""
    out = dict(spec)
    for key in ("hidden_size", "intermediate_size", "vocab_size") + (() if keep_heads else
                                                                      ("num_attention_heads", "num_key_value_heads")):
        out[key] = max(1, spec[key] // s)
    return out


def twin_groups(groups: list | None, s: int) -> list:
    """``memory_twin.twin_peaks``' groups at the GPU's size: ``[{label, count, each_gib}]`` (CPU bytes times s^2)."""
    return [dict(label=g["label"], count=g["count"], each_gib=g["each_mib"] / 1024 * s**2) for g in groups or []]


def twin_lines(groups: list, top: int = 14) -> list:
    """The printed lines of :func:`twin_groups`' largest ``top`` groups."""
    return [f"      {g['each_gib'] * g['count']:7.2f} GiB = {g['count']:>3} x {g['each_gib']:.3f}  {g['label']}"
            for g in groups[:top]]


if __name__ == "__main__":  # build_depth_model's process
    print(_depth_build(*sys.argv[1:4]))
