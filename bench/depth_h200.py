"""Real-depth LLaMA-Factory SFT on one H200 (world size 1): the Llama-3-8B shape at its full 32 layers (real 128k head,
random weights, max_position_embeddings 131072), LoRA r16 `lora_target: all` + `additional_target:
embed_tokens,lm_head`, bf16, packing, LLaMA-Factory's defaults otherwise (gradient checkpointing on). Each run is
bench/common.py's run (torchrun + bench/lf_bench_launch.py, a `llamafactory-cli train` equivalent with a timing /
memory callback); tokens/s = tokens a step / median step time after step 1; peak = torch.cuda.max_memory_allocated.

For each variant -- plain, liger (`enable_liger_kernel`), plugin (`liger_fsdp: true`), plugin+liger (both), and
plugin-lean / plugin-lean+liger (`liger_fsdp_backend: triton`) -- the script searches the longest `cutoff_len` of
4k ... 128k that trains its steps, and records tokens/s and peak memory at each cutoff it ran. One row per run is
appended to --out (``{"rows": [...]}``: model, layers, stage, sharding, variant, cutoff, images, fits, tokens_per_s,
peak_gib, step_losses, error, run, date, card, and the step times, phase peaks, versions, wall time).

Phases (--plan, in order; each draws its next run from the rows so far, the earlier calls' included):
  sweep   FSDP2, each --variants: first --start; up the ladder while it fits (--jump variants: to the top, then
          halving the gap to a failure), down while it does not; level by level (the smallest next cutoff first)
  repeat  a second (--repeats) run at the longest cutoff that plain and plugin both fit, and at the one that liger and
          plugin+liger both fit
  lean    plugin-lean and plugin-lean+liger at the cutoff where memory decides: the plugin's first failing cutoff
          where Liger fits, else the plugin's longest
  zero3   the plugin under DeepSpeed ZeRO-3 as shipped (bench/common.py's ds_json) at --zero3-cutoffs, --zero3-steps
          steps (its steps 2-4 are DeepSpeed's warm-up); sharding zero3-persist (--runs only) is the same with every
          parameter persistent (stage3_param_persistence_threshold 1e11: no per-layer gather / release), to attribute
          ZeRO-3's gap to FSDP2
  fill    the cutoffs from --fill-from up that a variant has not run below its longest (64k, 16k, 8k, ...)
--runs SHARDING:VARIANT:CUTOFF[:STEPS],... runs those first, whatever the rows hold.

--deadline S: no run starts that would end (overhead + steps x the step time measured or extrapolated at that cutoff)
more than S s after the start; a run stopped at the deadline leaves no row. The model is built once per machine
(WORK/llama3-8b-L32, kept for later calls on a warm machine) in a process of its own.

    python bench/depth_h200.py [--plan sweep,repeat,lean,zero3,fill] [--variants plain,liger,plugin,plugin+liger]
                               [--start 32768] [--steps 5] [--long-steps N --long-from 131072] [--deadline 540]
                               [--out bench/results/h200_depth.json] [--dry-run]
    python bench/depth_h200.py --smoke          # CPU plumbing check: tiny local model, fp32, no FSDP, temp JSON
    python bench/depth_h200.py --table          # the table and the targets from --out, nothing run
    python bench/depth_h200.py --plot           # and the two charts: results/h200_depth_longest.png, _tokens.png
    python bench/depth_h200.py --plot --out bench/results/h100_depth.json   # an H100's rows: h100_depth_*.png

On the H200 through the device tool: ``DEPTH_ARGS="..." bash bench/run_h200.sh depth`` (copies bench/results/
h200_depth.json to $OUT first, appends there: copy it back between calls).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import (DEPTH_MODEL, MAKE_ASSETS, MODELS, ROOT, append_row, build_depth_model, card, ds_json, load_rows,
                    log_line, now, preflight, rows_for_card, run, versions)
from common import VARIANTS as RUN_VARIANTS

SPEC = MODELS[DEPTH_MODEL["spec"]]
LAYERS = DEPTH_MODEL["layers"]
LADDER = (4096, 8192, 16384, 32768, 65536, 131072)  # the top is DEPTH_MODEL's max_position
SMOKE_LADDER = (64, 128, 256, 512)  # the tiny model's max_position_embeddings is 512
# variant -> (bench/common.py's VARIANTS key, extra yaml keys)
VARIANTS = {
    "plain": ("plain", {}),
    "liger": ("liger", {}),
    "plugin": ("liger_fsdp_auto", {}),  # default backend: triton_fast on CUDA
    "plugin+liger": ("liger+liger_fsdp", {}),
    "plugin-lean": ("liger_fsdp", {}),  # liger_fsdp_backend: triton
    "plugin-lean+liger": ("liger+liger_fsdp", {"liger_fsdp_backend": "triton"}),
    "plugin-noguard": ("liger_fsdp_noguard", {}),  # liger_fsdp_guard: false (step 1's time without the guard)
}
MAIN4 = ("plain", "liger", "plugin", "plugin+liger")
SHARDINGS = ("fsdp2", "zero3", "zero3-persist")
PAIRS = (("plain", "plugin"), ("liger", "plugin+liger"))  # the speed targets' pairs
SETUP = ("Llama-3-8B shape, 32 layers, LoRA r16 all + embed_tokens,lm_head, bf16, packing, gradient checkpointing, "
         "world size 1")
SMOKE_ROWS, SMOKE_WORDS = 200, (6, 24)


def short(cutoff):
    return f"{cutoff // 1024}k" if cutoff >= 1024 else str(cutoff)


# ---------------------------------------------------------------------------------------------------------- rows


def mine(rows, smoke, stage="sft"):
    """This script's rows (bench/depth_dpo_vlm_h200.py's share the file: they carry a ``part``)."""
    return [r for r in rows if bool(r.get("smoke")) == smoke and r.get("stage") == stage and not r.get("superseded")
            and not r.get("part")]


def results(rows, sharding, variant):
    """(cutoffs that trained, cutoffs that did not) of one variant; a cutoff that trained once counts as fitting."""
    fit = {r["cutoff"] for r in rows if r["sharding"] == sharding and r["variant"] == variant and r["fits"]}
    fail = {r["cutoff"] for r in rows if r["sharding"] == sharding and r["variant"] == variant and not r["fits"]}
    return fit, fail - fit


def longest(rows, sharding, variant):
    fit, _ = results(rows, sharding, variant)
    return max(fit) if fit else None


def runs_of(rows, sharding, variant, cutoff, fits=None):
    return [r for r in rows if (r["sharding"], r["variant"], r["cutoff"]) == (sharding, variant, cutoff)
            and (fits is None or r["fits"] == fits)]


def median_of(rows, key, sharding, variant, cutoff):
    vals = [r[key] for r in runs_of(rows, sharding, variant, cutoff, fits=True) if r.get(key) is not None]
    return statistics.median(vals) if vals else None


# ---------------------------------------------------------------------------------------------------------- plan


class Planner:
    """The next run of each phase, from the rows so far (this call's and earlier calls')."""

    def __init__(self, args, ladder):
        self.args, self.ladder = args, ladder
        self.blocked = set()  # (sharding, variant, cutoff) skipped this call (deadline): not offered again
        self.explicit = [self._parse(s) for s in (args.runs.split(",") if args.runs else [])]

    def _parse(self, text):
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[1] not in VARIANTS or parts[0] not in SHARDINGS:
            raise SystemExit(f"--runs: {text!r} is not SHARDING:VARIANT:CUTOFF[:STEPS] "
                             f"({'|'.join(SHARDINGS)}, one of {', '.join(VARIANTS)})")
        return parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) == 4 else None

    def steps(self, sharding, cutoff):
        if sharding.startswith("zero3"):
            return self.args.zero3_steps
        return self.args.long_steps if self.args.long_steps and cutoff >= self.args.long_from else self.args.steps

    def open(self, key):
        return key not in self.blocked

    def next(self, phase, rows):
        a, ladder = self.args, self.ladder
        if phase == "explicit":
            while self.explicit:
                sharding, variant, cutoff, steps = self.explicit.pop(0)
                if self.open((sharding, variant, cutoff)):
                    return sharding, variant, cutoff, steps or self.steps(sharding, cutoff)
            return None
        cands = []  # (order key, sharding, variant, cutoff)
        variants = [v for v in a.variants.split(",")]
        jump = set((a.jump or "").split(","))
        if phase == "sweep":
            for i, v in enumerate(variants):
                fit, fail = results(rows, "fsdp2", v)
                if any(not self.open(("fsdp2", v, c)) for c in ladder):
                    continue  # its search waits on a run this call could not make
                if not fit:
                    if not fail:
                        c = a.start
                    else:
                        below = [c for c in ladder if c < min(fail) and c not in fail]
                        c = max(below) if below else None
                else:  # up: one rung, or (--jump) straight to the top, then halving the gap to a failure
                    hi = min([c for c in fail if c > max(fit)], default=None)
                    above = [c for c in ladder if max(fit) < c <= a.max_cutoff and (hi is None or c < hi)]
                    c = None if not above else above[0] if v not in jump else above[-1] if hi is None else \
                        above[len(above) // 2]
                if c is not None:
                    cands.append(((c, i), "fsdp2", v, c))
        elif phase == "repeat":
            for a_v, b_v in PAIRS:
                if a_v not in variants or b_v not in variants:
                    continue
                common = results(rows, "fsdp2", a_v)[0] & results(rows, "fsdp2", b_v)[0]
                if not common:
                    continue
                c = max(common)
                for j, v in enumerate((a_v, b_v)):
                    n = len(runs_of(rows, "fsdp2", v, c))
                    if n < a.repeats:
                        cands.append(((n, c, j if n % 2 == 0 else -j), "fsdp2", v, c))  # cheap first; alternate
        elif phase == "lean":
            fit_p, fail_p = results(rows, "fsdp2", "plugin")
            fit_l, _ = results(rows, "fsdp2", "liger")
            decides = [c for c in fail_p if fit_l and c <= max(fit_l)]
            c = min(decides) if decides else (max(fit_p) if fit_p else None)
            if c is not None:
                for j, v in enumerate(("plugin-lean", "plugin-lean+liger")):
                    if not runs_of(rows, "fsdp2", v, c):
                        cands.append(((j,), "fsdp2", v, c))
        elif phase == "zero3":
            for j, c in enumerate(int(x) for x in a.zero3_cutoffs.split(",") if x):
                if not runs_of(rows, "zero3", "plugin", c):
                    cands.append(((j,), "zero3", "plugin", c))
        elif phase == "fill":
            for i, v in enumerate(variants):
                fit, fail = results(rows, "fsdp2", v)
                if not fit:
                    continue
                for c in ladder:  # below the first cutoff run, and the rungs a --jump passed over
                    if c >= a.fill_from and c < max(fit) and c not in fit | fail:
                        cands.append(((-c, i), "fsdp2", v, c))
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        cands = [x for x in cands if self.open(x[1:])]
        if not cands:
            return None
        _, sharding, variant, cutoff = min(cands, key=lambda x: x[0])
        return sharding, variant, cutoff, self.steps(sharding, cutoff)


# ---------------------------------------------------------------------------------------------------------- time


def step_time(rows, sharding, cutoff, smoke):
    """Seconds a step at this cutoff: the slowest variant measured there, else extrapolated from the nearest cutoff
    measured as cutoff^1.6 (the attention's share grows with the length), else a prior (32k: 6 s)."""
    meas = {}
    for r in rows:
        if r["fits"] and r.get("step_s") and r["sharding"] in (sharding, "fsdp2"):
            scale = 1.0 if r["sharding"] == sharding else 1.3  # ZeRO-3 from FSDP2 figures
            meas[r["cutoff"]] = max(meas.get(r["cutoff"], 0.0), r["step_s"] * scale)
    if cutoff in meas:
        return meas[cutoff]
    if meas:
        c0 = min(meas, key=lambda c: abs(math.log(c / cutoff)))
        return meas[c0] * (cutoff / c0) ** 1.6
    return (0.5 if smoke else 6.0) * (cutoff / (256 if smoke else 32768)) ** 1.6


def overhead(rows, sharding, smoke):
    """Seconds of a run beyond its steps (start, load, shard, tokenize): the median measured, else a prior."""
    vals = [r["wall_s"] - sum(r["step_times"]) for r in rows if r["fits"] and r.get("step_times") and r.get("wall_s")
            and r["sharding"] == sharding]
    if vals:
        return statistics.median(vals)
    return (40.0 if smoke else 75.0) * (1.0 if sharding == "fsdp2" else 1.4)


def predict(rows, sharding, cutoff, steps, smoke):
    return overhead(rows, sharding, smoke) + (steps + 0.5) * step_time(rows, sharding, cutoff, smoke)


# ---------------------------------------------------------------------------------------------------------- runs


def asset_dir(work, smoke):
    return os.path.join(work, "smoke" if smoke else DEPTH_MODEL["name"])


def assets(work, smoke):
    mdir = asset_dir(work, smoke)
    if os.path.exists(os.path.join(mdir, "model", "config.json")):
        return mdir
    if smoke:
        subprocess.run([sys.executable, MAKE_ASSETS, mdir, "--rows", str(SMOKE_ROWS), "--answer-words",
                        *map(str, SMOKE_WORDS)], check=True)
        return mdir
    return build_depth_model(work)


def run_args(work, mdir, sharding, variant, cutoff, smoke):
    key, extra = VARIANTS[variant]
    cfg = {"dataset": "tiny_alpaca", "tokenized_path": os.path.join(mdir, f"tokenized_sft_{cutoff}"), **extra}
    env = {}
    if sharding.startswith("zero3") and not smoke:
        persistence = 1e11 if sharding == "zero3-persist" else None
        cfg.update(fsdp=None, fsdp_config=None, deepspeed=ds_json(work, persistence=persistence))
    if smoke:  # one CPU process: no FSDP / DeepSpeed, fp32; Liger's loss only, interpreted
        cfg.update(fsdp=None, fsdp_config=None, bf16=None, use_cpu=True, preprocessing_num_workers=None)
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", LF_BENCH_LIGER_LOSS_ONLY="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return key, cfg, env


def one_run(args, rows, work, mdir, sharding, variant, cutoff, steps, timeout, meta):
    key, cfg, env = run_args(work, mdir, sharding, variant, cutoff, args.smoke)
    nrun = 1 + max((r["run"] for r in runs_of(rows, sharding, variant, cutoff)), default=0)
    tag = f"{sharding}_{variant}_{cutoff}_r{nrun}"
    if args.dry_run:
        res = run(mdir, SPEC, key, steps, work, cutoff=cutoff, overrides=cfg, tag=tag, launch=False)
        print(f"### {tag} env={env}\n{open(res['yaml']).read()}")
        return None
    fake = f"{variant}:{cutoff}" in (args.smoke_fail or "").split(",")
    start = time.monotonic()
    if fake:  # --smoke only: the search's plumbing for a run that does not fit
        row = {"rc": 1, "error": "smoke: simulated failure (--smoke-fail)", "log": ""}
    else:
        row = run(mdir, SPEC, key, steps, work, cutoff=cutoff, overrides=cfg, env=env, tag=tag, timeout=timeout)
    wall = time.monotonic() - start
    if str(row.get("error", "")).startswith("timeout"):
        return "timeout"
    log = open(row["log"]).read() if row.get("log") and os.path.exists(row["log"]) else ""
    if "log_tail" in row:  # keep the worker's traceback, not torchrun's own
        row["log_tail"] = row["log_tail"].split("torch/distributed/elastic/multiprocessing/api.py")[0][-1500:]
    done = len(row.get("step_times") or [])
    fits = not row.get("rc") and done == steps
    out = dict(model="llama3-8b" if not args.smoke else "tiny", layers=LAYERS if not args.smoke else 2, stage="sft",
               sharding=sharding, variant=variant, cutoff=cutoff, images=0, fits=fits,
               tokens_per_s=row.get("tokens_per_s") if fits else None, peak_gib=row.get("peak_gib"),
               step_losses=row.get("step_losses"), error=None if fits else (row.get("error") or f"{done}/{steps} steps"),
               run=nrun, date=now(), card=meta["card"], steps=steps, step_times=row.get("step_times"),
               step_s=row.get("step_s"), tokens_per_step=row.get("tokens_per_step"), wall_s=round(wall, 1),
               step1_peak_gib=row.get("step1_peak_gib"),
               **{f"{p}_peak_gib": row.get(f"{p}_peak_gib") for p in ("setup", "between", "forward", "backward", "optimizer")},
               losses=row.get("losses"), engaged=row.get("engaged"), memory_line=row.get("memory_line"),
               liger_line=log_line(log, "Liger kernel has been applied"),
               cast=log_line(log, "[liger_fsdp] DeepSpeed ZeRO-3: train"), log_tail=row.get("log_tail"),
               variant_yaml={k: v for k, v in {**RUN_VARIANTS[key], **cfg}.items()
                             if k.startswith(("liger", "enable_liger"))},
               setup=SETUP if not args.smoke else "smoke: tiny model, CPU, fp32, no FSDP", versions=meta["versions"],
               plugin_commit=meta["commit"], session=meta["session"], smoke=args.smoke)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default="sweep,repeat,lean,zero3,fill", help="phases after --runs; none: --runs only")
    ap.add_argument("--variants", default=",".join(MAIN4), help="the sweep's (and fill's) variants")
    ap.add_argument("--runs", default=None, help="SHARDING:VARIANT:CUTOFF[:STEPS],... run first")
    ap.add_argument("--start", type=int, default=None, help="the sweep's first cutoff (default 32768; smoke 128)")
    ap.add_argument("--jump", default=None, help="variants whose search goes from a fit straight to --max-cutoff "
                    "(then halves the gap to a failure) instead of one rung up")
    ap.add_argument("--max-cutoff", type=int, default=None, help="the sweep's last (default 131072; smoke 256)")
    ap.add_argument("--fill-from", type=int, default=None, help="fill's smallest cutoff (default 16384; smoke 64)")
    ap.add_argument("--steps", type=int, default=None, help="default 5 (smoke 3)")
    ap.add_argument("--long-steps", type=int, default=None, help="steps at cutoffs >= --long-from (default --steps)")
    ap.add_argument("--long-from", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--zero3-cutoffs", default="32768,16384")
    ap.add_argument("--zero3-steps", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start; no run starts past it")
    ap.add_argument("--out", default=None, help="default bench/results/h200_depth.json (smoke: a temp file)")
    ap.add_argument("--work", default=None, help="default /tmp/real_size (smoke: /tmp/depth_smoke)")
    ap.add_argument("--dry-run", action="store_true", help="write and print the first run of each phase's yaml")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on the tiny local model")
    ap.add_argument("--smoke-fail", default=None, help="smoke only: VARIANT:CUTOFF,... recorded as not fitting")
    ap.add_argument("--table", action="store_true", help="print the table and targets from --out; run nothing")
    ap.add_argument("--plot", action="store_true", help="--table, and draw the charts next to --out")
    args = ap.parse_args()
    smoke = args.smoke
    ladder = SMOKE_LADDER if smoke else LADDER
    args.start = args.start or (128 if smoke else 32768)
    args.max_cutoff = args.max_cutoff or (256 if smoke else LADDER[-1])
    args.fill_from = args.fill_from or (64 if smoke else 16384)
    args.steps = args.steps or (3 if smoke else 5)
    if smoke and args.plan == ap.get_default("plan"):
        args.plan = "sweep,repeat,lean,fill"
    out = args.out or (os.path.join(tempfile.gettempdir(), "h200_depth_smoke.json") if smoke else
                       os.path.join(ROOT, "bench", "results", "h200_depth.json"))
    if args.table or args.plot:
        report(mine(load_rows(out), smoke), ladder)
        if args.plot:
            plot(mine(load_rows(out), smoke), ladder, out, smoke)
        return
    work = args.work or ("/tmp/depth_smoke" if smoke else "/tmp/real_size")
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    commit_file = os.path.join(ROOT, ".whl", "PLUGIN_COMMIT")
    meta = {"card": "cpu (smoke)" if smoke else card(), "versions": versions(), "session": now(),
            "commit": open(commit_file).read().strip() if os.path.exists(commit_file) else None}
    out = rows_for_card(out, meta["card"])
    print(f"[depth] {meta['card']}; " + " ".join(f"{k} {v}" for k, v in meta["versions"].items() if v), flush=True)
    planner, done, skipped = Planner(args, ladder), [], []
    phases = [p for p in args.plan.split(",") if p not in ("", "none")]
    zero3 = "zero3" in phases or any(sharding.startswith("zero3") for sharding, *_ in planner.explicit)
    if zero3 and not smoke and not args.dry_run:
        preflight("deepspeed.runtime.zero.stage3")
    mdir = asset_dir(work, smoke) if args.dry_run else assets(work, smoke)
    for phase in ["explicit"] + phases:
        while True:
            rows = mine(load_rows(out), smoke)
            nxt = planner.next(phase, rows)
            if nxt is None:
                break
            sharding, variant, cutoff, steps = nxt
            key = (sharding, variant, cutoff)
            if args.dry_run:
                one_run(args, rows, work, mdir, sharding, variant, cutoff, steps, None, meta)
                planner.blocked.add(key)
                continue
            elapsed = time.monotonic() - t0
            guess = predict(rows, sharding, cutoff, steps, smoke)
            if args.deadline and elapsed + guess > args.deadline:
                skipped.append(f"{phase}:{sharding}:{variant}:{short(cutoff)} (~{guess:.0f} s)")
                planner.blocked.add(key)
                continue
            timeout = max(30, args.deadline - elapsed) if args.deadline else 3600
            print(f"[depth] {phase}: {sharding} {variant} {short(cutoff)} x{steps} steps (~{guess:.0f} s, "
                  f"{elapsed:.0f} s in)", flush=True)
            row = one_run(args, rows, work, mdir, sharding, variant, cutoff, steps, timeout, meta)
            if row == "timeout":
                skipped.append(f"{phase}:{sharding}:{variant}:{short(cutoff)} (stopped at the deadline)")
                planner.blocked.add(key)
                continue
            append_row(out, row)
            done.append(row)
            print(f"[depth] -> {'fits' if row['fits'] else 'does not fit'}: {row['tokens_per_s'] or 0:.0f} tok/s, "
                  f"{row['peak_gib'] or 0:.2f} GiB, {row['wall_s']:.0f} s wall "
                  f"{'' if row['fits'] else (row['error'] or '')[:160]}", flush=True)
    if args.dry_run:
        return
    print(f"\n[depth] {len(done)} run(s) this call, {time.monotonic() - t0:.0f} s; rows in {out}")
    if skipped:
        print(f"[depth] not run (--deadline {args.deadline:.0f} s): " + "; ".join(skipped))
    report(mine(load_rows(out), smoke), ladder)


# ---------------------------------------------------------------------------------------------------------- report


def bf16_ulps(a, b):
    """|a - b| in units of bf16's spacing at b (8 significant bits)."""
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / 2.0 ** (math.floor(math.log2(abs(b))) - 7)


def cell(rows, sharding, variant, cutoff):
    ok = runs_of(rows, sharding, variant, cutoff, fits=True)
    bad = runs_of(rows, sharding, variant, cutoff, fits=False)
    if ok:
        tps = "/".join(f"{r['tokens_per_s'] / 1e3:.2f}k" for r in ok)
        steps = {r["steps"] for r in ok}
        usual = statistics.mode(r["steps"] for r in rows)
        return (f"{tps} @{statistics.median(r['peak_gib'] for r in ok):.1f}" + (f" (+{len(bad)} failed)" if bad else "")
                + (f" ({'/'.join(map(str, sorted(steps)))} steps)" if steps != {usual} else ""))
    if bad:
        err = bad[-1]["error"] or ""
        return "OOM" if "out of memory" in err.lower() or "OutOfMemory" in err else "fails"
    return "-"


def report(rows, ladder):
    """The table (tokens/s per run @ median peak GiB, per cutoff), each variant's longest cutoff, and the targets."""
    if not rows:
        print("no rows")
        return
    keys = sorted({(r["sharding"], r["variant"]) for r in rows},
                  key=lambda k: (k[0] != "fsdp2", list(VARIANTS).index(k[1])))
    cuts = [c for c in ladder if any(r["cutoff"] == c for r in rows)]
    print("\n| sharding | variant | longest | " + " | ".join(short(c) for c in cuts) + " |")
    print("|---|---|---|" + "---|" * len(cuts))
    for sharding, variant in keys:
        lc = longest(rows, sharding, variant)
        print(f"| {sharding} | {variant} | {short(lc) if lc else 'none'} | "
              + " | ".join(cell(rows, sharding, variant, c) for c in cuts) + " |")
    print("(cells: tokens/s of each run @ median peak GiB)")
    for r in rows:
        if not r["fits"]:
            print(f"  {r['sharding']} {r['variant']} {short(r['cutoff'])} r{r['run']}: {(r['error'] or '')[:200]}")
    print("\ntargets:")
    for line in targets(rows, ladder):
        print("  " + line)


def targets(rows, ladder):
    out = []
    L = {v: longest(rows, "fsdp2", v) for v in MAIN4}
    top = " (the ladder's top: at least)" if L.get("plugin") == ladder[-1] else ""
    if L["plugin"] and L["plain"]:
        out.append(f"plugin's longest {short(L['plugin'])} >= 2x plain's {short(L['plain'])}: "
                   f"{'met' if L['plugin'] >= 2 * L['plain'] else 'NOT met'}{top}")
    if L["plugin"] and L["liger"]:
        out.append(f"plugin's longest {short(L['plugin'])} >= Liger's {short(L['liger'])}: "
                   f"{'met' if L['plugin'] >= L['liger'] else 'NOT met'}")
    for a_v, b_v in PAIRS:
        common = results(rows, "fsdp2", a_v)[0] & results(rows, "fsdp2", b_v)[0]
        if not common:
            continue
        c = max(common)
        ta, tb = (median_of(rows, "tokens_per_s", "fsdp2", v, c) for v in (a_v, b_v))
        ra = [r["tokens_per_s"] for r in runs_of(rows, "fsdp2", a_v, c, True)]
        rb = [r["tokens_per_s"] for r in runs_of(rows, "fsdp2", b_v, c, True)]
        out.append(f"{b_v} tok/s >= 0.98x {a_v} at {short(c)} (longest both fit): {tb / ta:.3f}x "
                   f"({tb:.0f} vs {ta:.0f}, medians of {len(rb)} / {len(ra)}) -> "
                   f"{'met' if tb >= 0.98 * ta else 'NOT met'}")
    for c in ladder:
        first = {}
        for r in rows:
            if r["sharding"] == "fsdp2" and r["cutoff"] == c and r.get("step_losses") and r["variant"] not in first:
                first[r["variant"]] = r["step_losses"][0]
        ref = first.get("plain") or next(iter(first.values()), None)
        if len(first) > 1:
            ulps = {v: bf16_ulps(x, ref) for v, x in first.items()}
            out.append(f"step-1 loss at {short(c)}: " + ", ".join(f"{v} {x:.5f}" for v, x in first.items())
                       + f" -> max {max(ulps.values()):.2f} bf16 ulp of {'plain' if 'plain' in first else 'the first'}")
    for c in sorted({r["cutoff"] for r in rows if r["sharding"] == "zero3-persist"}):
        z, f = (median_of(rows, "tokens_per_s", s, "plugin", c) for s in ("zero3-persist", "fsdp2"))
        if z and f:
            out.append(f"ZeRO-3 plugin at {short(c)}, every parameter persistent (attribution, not a target): "
                       f"{z:.0f} vs FSDP2 {f:.0f} tok/s = {z / f:.3f}x")
    for c in sorted({r["cutoff"] for r in rows if r["sharding"] == "zero3"}):
        z, f = (median_of(rows, "tokens_per_s", s, "plugin", c) for s in ("zero3", "fsdp2"))
        zr = runs_of(rows, "zero3", "plugin", c)
        if z and f:
            out.append(f"ZeRO-3 plugin at {short(c)}: {z:.0f} vs FSDP2 {f:.0f} tok/s = {z / f:.3f}x -> "
                       f"{'met' if z >= 0.9 * f else 'NOT met'} (>= 0.9x)")
        elif zr and not any(r["fits"] for r in zr):
            out.append(f"ZeRO-3 plugin at {short(c)}: does not train ({(zr[-1]['error'] or '')[:120]})")
        elif z:
            out.append(f"ZeRO-3 plugin at {short(c)}: {z:.0f} tok/s (no FSDP2 plugin run at that cutoff)")
    return out


COLORS = {"plain": "tab:gray", "liger": "tab:orange", "plugin": "tab:blue", "plugin+liger": "tab:green",
          "plugin-lean": "tab:cyan", "plugin-lean+liger": "tab:olive", "plugin-noguard": "tab:purple"}


def card_of(rows) -> tuple[str, float | None]:
    """(the card's short name, its memory in GiB) from the rows' ``card`` field ("NVIDIA H100 80GB HBM3, 81559 MiB,
    driver"); a file holds one card's rows (common.rows_for_card)."""
    cards = {r.get("card") or "" for r in rows} or {""}
    if len(cards) > 1:
        raise SystemExit(f"rows of several cards: {sorted(cards)}")
    name, *rest = cards.pop().split(",")
    mib = rest[0].strip().split()[0] if rest else ""
    return name.replace("NVIDIA ", "").strip() or "cpu", int(mib) / 1024 if mib.isdigit() else None


def plot(rows, ladder, out, smoke):
    """The two charts of --out's rows, beside it: <stem>_longest.png and <stem>_tokens.png, titled with their card."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = os.path.splitext(os.path.abspath(out))[0]
    gpu, capacity = card_of(rows)
    variants = [v for v in VARIANTS if any(r["variant"] == v and r["sharding"] == "fsdp2" for r in rows)]
    # 1. the longest cutoff that trains, per variant (FSDP2), its first failing cutoff marked; not plugin-noguard,
    # which times step 1 at one cutoff and is never searched for length
    longest = [v for v in variants if v != "plugin-noguard"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(longest) + 1.6))
    for i, v in enumerate(longest):
        fit, fail = results(rows, "fsdp2", v)
        if fit:
            c = max(fit)
            ax.barh(i, math.log2(c), color=COLORS[v])
            peak = median_of(rows, "peak_gib", "fsdp2", v, c)
            tps = median_of(rows, "tokens_per_s", "fsdp2", v, c)
        above = [c for c in fail if not fit or c > max(fit)]
        if above:
            ax.plot(math.log2(min(above)), i, "rx", markersize=9)
        if fit:
            note = (f"; {short(min(above))} does not fit" if above else
                    "" if c >= ladder[-1] else "; longer not run")
            ax.text(math.log2(max([c] + above[:1])) + 0.2, i, f"{short(c)}: {tps / 1e3:.2f}k tok/s, {peak:.1f} GiB{note}",
                    va="center", fontsize=8)
    ax.set_yticks(range(len(longest)), longest)
    ax.set_xticks([math.log2(c) for c in ladder], [short(c) for c in ladder])
    ax.set_xlim(math.log2(ladder[0]) - 0.5, math.log2(ladder[-1]) + 3.2)
    ax.invert_yaxis()
    ax.set_xlabel("longest cutoff_len that trains (x: first that does not)")
    ax.set_title(f"Llama-3-8B, 32 layers, FSDP2, one {gpu}: longest context" + (" (smoke)" if smoke else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(prefix + "_longest.png", dpi=120)
    plt.close(fig)
    # 2. tokens/s and peak memory against the cutoff
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in variants:
        for sharding, style in (("fsdp2", "-o"), ("zero3", "--s")):
            cs = sorted(results(rows, sharding, v)[0])
            if not cs:
                continue
            label = v if sharding == "fsdp2" else f"{v} (ZeRO-3)"
            a1.plot(cs, [median_of(rows, "tokens_per_s", sharding, v, c) for c in cs], style, color=COLORS[v], label=label)
            a2.plot(cs, [median_of(rows, "peak_gib", sharding, v, c) for c in cs], style, color=COLORS[v], label=label)
        fails = [c for c in results(rows, "fsdp2", v)[1]]
        for c in fails:
            a2.plot(c, capacity or 0, "x", color=COLORS[v], markersize=9)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ladder, [short(c) for c in ladder])
        ax.set_xlabel("cutoff_len (packed tokens a step; lines join the cutoffs run)")
        ax.grid(alpha=0.3)
    if capacity:
        a2.axhline(capacity, color="k", lw=0.8, ls=":")
        a2.text(ladder[0], capacity * 0.97, f"{gpu} {capacity:.1f} GiB (x: did not fit)", fontsize=8)
    a1.set_ylabel("tokens/s (median of runs; steps 2..n)")
    a2.set_ylabel("peak GiB (max_memory_allocated)")
    a1.legend(fontsize=8)
    fig.suptitle(f"Llama-3-8B, 32 layers, LoRA r16 all + embed/head copies, bf16, one {gpu}" + (" (smoke)" if smoke else ""),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(prefix + "_tokens.png", dpi=120)
    plt.close(fig)
    print(f"charts: {prefix}_longest.png {prefix}_tokens.png")


if __name__ == "__main__":
    main()
