"""Where one fused linear cross-entropy call's time goes on the GPU: device time vs host time, and what blocks the host.

For one shape (bf16, 30% ignored labels) and each implementation, forward+backward: the median CUDA-event time, the
median host wall time (synchronised), the sum of the kernels' device time over one profiled call (so the gaps
between kernels are event time minus it; ``timeline`` measures them inside the profiled call itself: span, busy, idle,
the largest gaps with their neighbours, kernel time per kind), the host ops that take the most self CPU time, the CUDA runtime calls that
can stall the host (synchronisations, allocations), and the peak memory beyond the inputs. ``project_fast@R`` runs
triton_fast with R rows a chunk.

    python bench/profile_flce.py --out bench/results/h200_profile.json [--shape 16384,4096,128256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from common import flce_impl

STALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
          "cudaEventSynchronize", "cudaHostAlloc")


def one(fn, h, w, y):
    h.grad = w.grad = None
    fn(h, w, y).backward()


def _timeline(kernels):
    """From the profiled call's own kernel start/end times: span, busy time, idle time, the largest idle gaps with the
    kernels on either side, and busy time per kind (GEMM, our Triton kernels, elementwise/other)."""
    ks = sorted(kernels, key=lambda e: e.time_range.start)
    if not ks:
        return {}
    span = (ks[-1].time_range.end - ks[0].time_range.start) / 1e3
    busy = sum(e.time_range.end - e.time_range.start for e in ks) / 1e3
    gaps = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name[:60], b.name[:60], i)
                  for i, (a, b) in enumerate(zip(ks, ks[1:])))[::-1][:10]
    kinds = {}
    for e in ks:
        name = e.name
        kind = ("gemm" if any(t in name for t in ("nvjet", "gemm", "cutlass", "sm90_xmma", "matmul")) else
                "triton" if name.startswith("_") else "elementwise/other")
        kinds[kind] = kinds.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    return {"span_ms": span, "busy_ms": busy, "idle_ms": span - busy, "kernels_by_kind_ms": kinds,
            "largest_gaps": [{"ms": g, "after": a, "before": b, "index": i} for g, a, b, i in gaps]}


def _ev():
    return torch.cuda.Event(enable_timing=True)


def modes(fn, h, w, y, reps):
    """Unprofiled event times of one call three ways: ``cold`` (GPU idle at the start, as the benchmark times it: the
    host's work before the first kernel counts), ``hidden`` (a GPU sleep queued first so the host's start is hidden:
    the GPU-bound time), ``steady`` (``reps`` calls back to back, per call); plus the forward's and backward's share
    of ``hidden`` (an event recorded when forward returns)."""
    sleep_cycles = int(3e7)  # ~15 ms on an H200
    sl = []
    for _ in range(3):
        a, b = _ev(), _ev()
        a.record()
        torch.cuda._sleep(sleep_cycles)
        b.record()
        torch.cuda.synchronize()
        sl.append(a.elapsed_time(b))
    sleep_ms = statistics.median(sl)
    hidden, fwd = [], []
    for _ in range(reps):
        h.grad = w.grad = None
        a, m, b = _ev(), _ev(), _ev()
        torch.cuda._sleep(sleep_cycles)
        a.record()
        loss = fn(h, w, y)
        m.record()
        loss.backward()
        b.record()
        torch.cuda.synchronize()
        hidden.append(a.elapsed_time(b))
        fwd.append(a.elapsed_time(m))
    a, b = _ev(), _ev()
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        one(fn, h, w, y)
    b.record()
    torch.cuda.synchronize()
    return {"hidden_ms": statistics.median(hidden), "hidden_fwd_ms": statistics.median(fwd),
            "steady_ms": a.elapsed_time(b) / reps, "sleep_ms": sleep_ms}


def profile(name, h, w, y, reps, trace=None):
    fn = flce_impl(name)
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
    timing_modes = modes(fn, h, w, y, reps)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    one(fn, h, w, y)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        one(fn, h, w, y)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(os.path.join(trace, f"trace_{name.replace('@', '_')}.json"))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time for e in kernels) / 1e3  # per-kernel durations, microseconds
    ops = prof.key_averages()
    cpu_top = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    stalls = {e.key: {"calls": e.count, "cpu_ms": e.self_cpu_time_total / 1e3} for e in ops
              if any(e.key.startswith(s) for s in STALLS)}
    timeline = _timeline(kernels)
    dev_top = sorted((e for e in ops if e.key in {k.name for k in kernels}),
                     key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:12]
    return {"impl": name, "event_ms": statistics.median(events), "wall_ms": statistics.median(walls),
            "kernel_ms": device_ms, "gap_ms": statistics.median(events) - device_ms, "peak_extra_mib": peak,
            "kernels": len(kernels), "stalls": stalls, "timeline": timeline, "modes": timing_modes,
            "cpu_top": [{"name": e.key[:100], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
                        for e in cpu_top],
            "device_top": [{"name": e.key[:100], "calls": e.count,
                            "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in dev_top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200_profile.json")
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--impls", default="project_fast,project_fast@2048,project_fast@4096,project,liger")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trace", default=None, help="also write each profiled call's chrome trace into this folder")
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
            rows.append(dict(profile(name, h, w, y, args.reps, args.trace), shape=[n, hd, v]))
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
        mo = r.get("modes") or {}
        if mo:
            print(f"   unprofiled: cold {r['event_ms']:.2f} ms, GPU-bound (host start hidden) {mo['hidden_ms']:.2f} "
                  f"(forward {mo['hidden_fwd_ms']:.2f}), back to back {mo['steady_ms']:.2f}")
        print("   cpu: " + "; ".join(f"{o['name'][:40]} {o['self_cpu_ms']:.1f}ms/{o['calls']}" for o in r["cpu_top"][:6]))
        t = r.get("timeline") or {}
        if t:
            print(f"   profiled call: span {t['span_ms']:.2f} ms, busy {t['busy_ms']:.2f}, idle {t['idle_ms']:.2f}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in t["kernels_by_kind_ms"].items()))
            for g in t["largest_gaps"][:6]:
                print(f"     gap {g['ms']:.3f} ms after {g['after']} before {g['before']} (#{g['index']})")


if __name__ == "__main__":
    main()
