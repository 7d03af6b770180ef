"""Where one fused linear cross-entropy call's time goes on the GPU: device time vs host time, and what blocks the host.

For one shape (bf16, 30% ignored labels) and each implementation, forward+backward: the median CUDA-event time, the
median host wall time (synchronised), the sum of the kernels' device time over one profiled call (so the gaps
between kernels are event time minus it), the host ops that take the most self CPU time, the CUDA runtime calls that
can stall the host (synchronisations, allocations), and the peak memory beyond the inputs. ``project_fast@R`` runs
triton_fast with R rows a chunk.

    python bench/profile_flce.py --out bench/results/h200_flce_profile.json [--shape 16384,4096,128256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
          "cudaEventSynchronize", "cudaHostAlloc")


def impl(name):
    if name.startswith("project_fast"):
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy, triton_flce

        rows = int(name.split("@")[1]) if "@" in name else triton_flce.FAST_CHUNK_ROWS

        def fn(h, w, y):
            triton_flce.FAST_CHUNK_ROWS = rows
            return fused_linear_cross_entropy(h, w, y, backend="triton_fast")

        return fn
    if name == "project":
        from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy

        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend="triton")
    if name == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: loss(w, h, y)
    if name == "torch":
        return lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y)
    raise ValueError(name)


def one(fn, h, w, y):
    h.grad = w.grad = None
    fn(h, w, y).backward()


def profile(name, h, w, y, reps):
    fn = impl(name)
    for _ in range(3):
        one(fn, h, w, y)
    torch.cuda.synchronize()
    events, walls = [], []
    import time

    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        one(fn, h, w, y)
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        events.append(start.elapsed_time(end))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    one(fn, h, w, y)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        one(fn, h, w, y)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time for e in kernels) / 1e3  # per-kernel durations, microseconds
    ops = prof.key_averages()
    cpu_top = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    stalls = {e.key: {"calls": e.count, "cpu_ms": e.self_cpu_time_total / 1e3} for e in ops
              if any(e.key.startswith(s) for s in STALLS)}
    dev_top = sorted((e for e in ops if e.key in {k.name for k in kernels}),
                     key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:12]
    return {"impl": name, "event_ms": statistics.median(events), "wall_ms": statistics.median(walls),
            "kernel_ms": device_ms, "gap_ms": statistics.median(events) - device_ms, "peak_extra_mib": peak,
            "kernels": len(kernels), "stalls": stalls,
            "cpu_top": [{"name": e.key[:100], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
                        for e in cpu_top],
            "device_top": [{"name": e.key[:100], "calls": e.count,
                            "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in dev_top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_flce_profile.json")
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--impls", default="project_fast,project_fast@2048,project_fast@4096,project,liger")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    n, hd, v = map(int, args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, hd, device="cuda", generator=g) / hd**0.25).bfloat16().requires_grad_()
    w = (torch.randn(v, hd, device="cuda", generator=g) / hd**0.25).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < 0.3] = -100
    rows = []
    for name in args.impls.split(","):
        try:
            rows.append(dict(profile(name, h, w, y, args.reps), shape=[n, hd, v]))
        except Exception as exc:  # e.g. liger-kernel not installed
            rows.append({"impl": name, "shape": [n, hd, v], "error": f"{type(exc).__name__}: {exc}"[:300]})
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'impl':20s} {'event ms':>9s} {'wall ms':>8s} {'kernel ms':>9s} {'gap ms':>7s} {'peak MiB':>9s}  stalls")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:20s} {r['error']}")
            continue
        stall = " ".join(f"{k}x{v['calls']}:{v['cpu_ms']:.1f}ms" for k, v in r["stalls"].items())
        print(f"{r['impl']:20s} {r['event_ms']:9.2f} {r['wall_ms']:8.2f} {r['kernel_ms']:9.2f} {r['gap_ms']:7.2f} "
              f"{r['peak_extra_mib']:9.0f}  {stall}")
        print("   cpu: " + "; ".join(f"{o['name'][:40]} {o['self_cpu_ms']:.1f}ms/{o['calls']}" for o in r["cpu_top"][:6]))


if __name__ == "__main__":
    main()
