"""One training step under the torch profiler (``LF_BENCH_PROFILE=k`` in a bench/lf_bench_launch.py run: step k): its
GPU time by who launched it -- ``kernel`` (the fused loss, forward and backward), ``gather`` (the head's weights through
its FSDP unit), ``head_rest`` (the rest of ``HeadLoss.loss`` / ``token_logps``), ``rest`` --; the step's wall time, the
GPU's busy / idle time, the head path's host syncs, host time and host ops (``head_host_top``), the GPU time no host op
claims (``unlinked_ms``). Plain and Liger runs get the same totals. :class:`Compiles`: each step's Triton compiles."""

from __future__ import annotations

import functools
import os

SCOPES = {"liger_fsdp.kernel": "kernel", "liger_fsdp.gather": "gather", "liger_fsdp.head": "head_rest"}
BACKWARD = "FLCEBackward"  # the ops' autograd Functions: _FastFLCE, _LeanFLCE, _StoredDzFLCE, _TorchFLCE
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY = "cudaMemcpyAsync"  # a sync too where it blocked > 50 us: .tolist()'s D2H copy to pageable memory waits


class Compiles:
    """A process's Triton JIT compiles ([kernel, seconds]; Triton's jit cache / post-compile hooks): one in a later step
    (a new specialization: another row count's divisibility or alignment) stalls it. ``take()``: since the last take."""

    def __init__(self):
        import time
        self.done, t0 = [], {}
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        knobs.runtime.jit_cache_hook = lambda *, key, fn, **_: t0.__setitem__((fn.name, str(key)), time.perf_counter())
        knobs.runtime.jit_post_compile_hook = lambda *, key, fn, **_: self.done.append(
            [fn.name, round(time.perf_counter() - t0.pop((fn.name, str(key)), time.perf_counter()), 3)])

    def take(self) -> list:
        out, self.done = self.done, []
        return out


def wanted() -> int:
    """The step to profile (0: none)."""
    return int(os.environ.get("LF_BENCH_PROFILE") or 0)


def install() -> None:
    """Name the plugin's head path for the profiler: a ``record_function`` around three of its functions."""
    from torch.profiler import record_function

    from llamafactory_liger_fsdp import gather, losses, ops
    def named(owner, attr, label):
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)

        setattr(owner, attr, wrapped)

    named(ops, "fused_linear_cross_entropy", "liger_fsdp.kernel")
    named(gather, "call_through", "liger_fsdp.gather")
    named(losses.HeadLoss, "loss", "liger_fsdp.head")
    named(losses.HeadLoss, "token_logps", "liger_fsdp.head")


def start():
    import torch
    act = torch.profiler.ProfilerActivity
    prof = torch.profiler.profile(activities=[act.CPU] + [act.CUDA] * torch.cuda.is_available())
    prof.__enter__()
    return prof


def bucket(evt) -> str | None:
    """The bucket of a CPU event's own kernels: that of its nearest named ancestor (itself included)."""
    while evt is not None:
        name = evt.name
        if name in SCOPES:
            return SCOPES[name]
        if name.endswith(BACKWARD):
            return "kernel"
        if name.startswith("FSDP::") and "lm_head" in name:
            return "gather"
        evt = evt.cpu_parent
    return None


def summary(prof, wall_s: float, top: int = 12) -> dict:
    """Stop ``prof``; the step's buckets (ms of GPU time), busy / idle ms, the head path's syncs, its top kernels."""
    from torch.autograd import DeviceType
    prof.__exit__(None, None, None)
    events = prof.events()
    ms, kernels = {"kernel": 0.0, "gather": 0.0, "head_rest": 0.0, "rest": 0.0}, {}
    syncs, head_cpu, unlinked, host = {"count": 0, "cpu_ms": 0.0}, 0.0, {}, {}  # unlinked: GPU time by kernel name
    for evt in events:
        if evt.device_type != DeviceType.CPU or evt.is_async:
            continue
        where = bucket(evt)
        if evt.name == "liger_fsdp.head" and bucket(evt.cpu_parent) is None:  # outermost: the host's time in the path
            head_cpu += evt.cpu_time_total / 1e3
        if where:  # the plugin's host ops by their own time (where the head path's host time goes)
            host[evt.name] = host.get(evt.name, 0.0) + evt.self_cpu_time_total / 1e3
        if where and (evt.name.startswith(SYNCS) or evt.name == COPY and evt.cpu_time_total > 50):
            syncs.update(count=syncs["count"] + 1, cpu_ms=syncs["cpu_ms"] + evt.cpu_time_total / 1e3)
        for k in evt.kernels:
            ms[where or "rest"] += k.duration / 1e3
            unlinked[k.name[:90]] = unlinked.get(k.name[:90], 0.0) - k.duration / 1e3
            if where:
                kernels[where, k.name[:90]] = kernels.get((where, k.name[:90]), 0.0) + k.duration / 1e3
    gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]  # not the ranges' spans
    busy, end = 0.0, float("-inf")  # the union of the GPU's intervals
    for s, e in sorted((e.time_range.start, e.time_range.end) for e in gpu):
        busy, end = busy + max(0.0, e - max(s, end)), max(end, e)
    busy_ms = busy / 1e3
    for e in gpu:  # less what the host ops claimed (above)
        unlinked[e.name[:90]] = unlinked.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    def ranked(d: dict, n: int = top) -> list:  # the largest first
        return sorted(d.items(), key=lambda kv: -kv[1])[:n]
    return dict(step_ms=round(wall_s * 1e3, 2), gpu_busy_ms=round(busy_ms, 2),
                gpu_idle_ms=round(wall_s * 1e3 - busy_ms, 2), **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                plugin_ms=round(ms["kernel"] + ms["gather"] + ms["head_rest"], 3), head_syncs=syncs,
                head_cpu_ms=round(head_cpu, 3), head_host_top=[dict(op=n, ms=round(v, 3)) for n, v in ranked(host, 8)],
                unlinked_ms=round(sum(v for v in unlinked.values() if v > 0), 3),
                unlinked_top=[dict(kernel=n, ms=round(v, 3)) for n, v in ranked(unlinked) if v > 0.01],
                top=[dict(bucket=b, kernel=n, ms=round(v, 3)) for (b, n), v in ranked(kernels)])


def profile_line(p: dict) -> str:
    """One line of a row's ``profile``."""
    return (f"step {p['step_ms']:.0f} ms, GPU busy {p['gpu_busy_ms']:.0f} (idle {p['gpu_idle_ms']:.0f}); plugin "
            f"{p['plugin_ms']:.1f} = kernel {p['kernel_ms']:.1f} + gather {p['gather_ms']:.1f} + head rest "
            f"{p['head_rest_ms']:.1f}; rest {p['rest_ms']:.0f}; head syncs {p['head_syncs']['count']}, host "
            f"{p['head_cpu_ms']:.1f} ms" + (f"; unlinked {p['unlinked_ms']:.0f}" if "unlinked_ms" in p else ""))
