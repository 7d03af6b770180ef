"""bench/step_profile.py's accounting of one profiled step, on synthetic profiler events (in-process, fast tier)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_profile_counts_kernels_not_the_ranges_spans():
    """bench/step_profile.summary: a ``record_function`` range's span on the GPU timeline (``## step``) is neither busy
    time nor unlinked time; the kernels go to the bucket of their nearest named host range; a GPU kernel no host op
    claims is unlinked."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "bench"))
    import step_profile

    def gpu(name, start, end, annotation=False):
        return NS(device_type=DeviceType.CUDA, is_async=False, name=name, kernels=[], cpu_parent=None,
                  time_range=NS(start=start, end=end), is_user_annotation=annotation, cpu_time_total=0)

    def cpu(name, kernels, parent=None, cpu_us=0):
        return NS(device_type=DeviceType.CPU, is_async=False, name=name, cpu_parent=parent, cpu_time_total=cpu_us,
                  self_cpu_time_total=cpu_us,
                  kernels=[NS(name=k, duration=d) for k, d in kernels], is_user_annotation=False)

    head = cpu("liger_fsdp.head", [], cpu_us=3000)
    scan = cpu("aten::copy_", [], cpu("liger_fsdp.kernel", [], head))  # the labels' .tolist(): the head's wait
    events = [cpu("## step", []), head, cpu("aten::mm", [("gemm", 4000)], cpu("liger_fsdp.kernel", [], head)),
              cpu("cudaMemcpyAsync", [], scan, cpu_us=2500), cpu("cudaMemcpyAsync", [], scan, cpu_us=20),
              cpu("cudaStreamSynchronize", [], scan, cpu_us=10), cpu("cudaMemcpyAsync", [], cpu_us=900),
              cpu("aten::mul", [("mul", 1000)]), gpu("## step", 0, 20000, annotation=True), gpu("gemm", 1000, 5000),
              gpu("mul", 6000, 7000), gpu("stray", 8000, 10000)]
    prof = NS(__exit__=lambda *a: None, events=lambda: events)
    p = step_profile.summary(prof, wall_s=0.02)
    assert (p["kernel_ms"], p["rest_ms"], p["gpu_busy_ms"], p["gpu_idle_ms"]) == (4.0, 1.0, 7.0, 13.0), p
    assert p["unlinked_ms"] == 2.0 and p["unlinked_top"] == [{"kernel": "stray", "ms": 2.0}], p
    assert p["head_cpu_ms"] == 3.0 and p["plugin_ms"] == 4.0
    assert p["head_syncs"] == {"count": 2, "cpu_ms": 2.51}, p  # the blocked copy and the sync, not a quick copy
    assert p["head_host_top"][:2] == [{"op": "liger_fsdp.head", "ms": 3.0}, {"op": "cudaMemcpyAsync", "ms": 2.52}], p
