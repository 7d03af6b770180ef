"""The CPU memory twin's in-process side: a GPU run's allocated memory predicted by a CPU run with every size divided
by s. Each allocation of a training step is a product of two of (tokens, hidden, intermediate, vocabulary, LoRA rank),
so the divided run allocates 1/s^2 of the GPU's, op for op, and on the CPU the profiler sees every allocation: its
peak x s^2 predicts the GPU's (bench/RESULTS.md 12). It lives here, not in bench/, because it runs inside the launched
training processes (bench/lf_bench_launch.py), as the other CPU stand-ins of this package do; bench/ keeps the launch
side (``LF_BENCH_TWIN=s``, the divided model) and the tables."""

from __future__ import annotations

TWIN_SIZES = (  # (module, constant, power of s it is divided by)
    ("ops.triton_common", "FAST_CHUNK_ROWS", 1), ("ops.triton_common", "FAST_CHUNK_MAX_BYTES", 2),
    ("ops.triton_common", "MAX_SLAB", 1), ("ops.triton_lean", "DEFAULT_MEM_BUDGET", 2),
    ("ops.triton_lean", "MIN_TILE", 1), ("ops.triton_lean", "MAX_ROWS", 1), ("ops.triton_lean", "TILE_CHARGE", 2),
    ("ops.triton_rows", "FAST_STORE_MAX_BYTES", 2), ("losses", "ROW_CHUNK_BYTES", 2), ("guard_slice", "BUDGET", 1),
    ("guard_slice", "LOGITS_BUDGET", 2))


def twin_setup(s: int) -> list:
    """In a twin's training process, what makes the CPU allocate as a GPU would: ``TWIN_SIZES`` divided, dropout's
    bool mask (CUDA's), each loaded weight its own allocation (the load itself left out), 128-row interpreted blocks
    (same values, fewer programs). Returns what was done, ``[name=value]``."""
    import importlib

    import torch
    import transformers

    from ..ops import upcast
    done = []
    for module, name, power in TWIN_SIZES:
        mod = importlib.import_module(f"llamafactory_liger_fsdp.{module}")
        setattr(mod, name, max(1, getattr(mod, name) // s**power))
        done.append(f"{module}.{name}={getattr(mod, name)}")

    def dropout(input, p=0.5, training=True, inplace=False):
        return torch.native_dropout(input, p, training)[0] if training and p > 0 else input

    torch.nn.functional.dropout = dropout
    done.append("F.dropout=native_dropout (bool mask)")
    from ..ops import triton_kernels
    # the interpreter's row block: 8x fewer interpreted programs (the dz kernel 2x faster), same values and allocations
    triton_kernels.block_r = lambda t: 1 if t.is_cuda else 128
    done.append("triton_kernels.block_r=128 on the CPU")
    from_pretrained = transformers.PreTrainedModel.from_pretrained.__func__

    def own_storage(cls, *args, **kwargs):
        with torch.profiler.record_function(upcast.SCOPE):
            model = from_pretrained(cls, *args, **kwargs)
        with torch.no_grad():
            model._apply(lambda t: t.clone())
        return model

    transformers.PreTrainedModel.from_pretrained = classmethod(own_storage)
    done.append("from_pretrained: each loaded tensor its own copy")
    return done


class AllocationTimeline:
    """The CPU allocations of a run profiled with ``profile_memory=True``: live bytes over time, the peak in a window
    and what is live at it, each allocation named by its op and nearest scope (FSDP, optimizer, autograd function,
    ``## marker``); the CPU-only copies of ``ops.upcast`` left out."""

    SCOPES = ("FSDP::", "Optimizer.", "## ", "autograd::engine::evaluate_function: ")

    def __init__(self, prof) -> None:
        import torch

        from ..ops import upcast
        alloc_type = torch._C._profiler._EventType.Allocation
        events, self.marks, stack = [], [], [(e, False) for e in prof.profiler.kineto_results.experimental_event_tree()]
        while stack:
            e, cpu_only = stack.pop()
            cpu_only = cpu_only or e.name == upcast.SCOPE
            stack.extend((c, cpu_only) for c in e.children)
            if e.typed[0] != alloc_type:
                if e.name.startswith("## ") or e.name.startswith("Optimizer.step"):
                    self.marks.append((e.name, e.start_time_ns, e.end_time_ns))
                continue
            f = e.typed[1]
            events.append((e.start_time_ns, f.alloc_size, f.ptr, self._label(e) if f.alloc_size > 0 else "", cpu_only))
        events.sort(key=lambda ev: ev[0])
        self.marks.sort(key=lambda m: m[1])
        # the CPU-only fp32 operand copies (ops/upcast.py) and their frees are left out: a GPU makes none
        self.events, skipped = [], set()
        for t, n, ptr, label, cpu_only in events:
            if n > 0 and cpu_only:
                skipped.add(ptr)
            elif n < 0 and ptr in skipped:
                skipped.discard(ptr)
            else:
                self.events.append((t, n, ptr, label))

    def _label(self, e) -> str:
        op, scope = e.parent.name if e.parent is not None else "?", None
        p = e.parent
        while p is not None and scope is None:
            name = p.name
            if name.startswith(self.SCOPES) or ("::" not in name and p is not e.parent and not name.startswith("<")):
                scope = name.replace("autograd::engine::evaluate_function: ", "backward ")
            p = p.parent
        return f"{scope} | {op}" if scope else op

    def windows(self, name: str) -> list:
        """(start, end) of every marker or optimizer step named ``name`` (prefix), in time order."""
        return [(t0, t1) for n, t0, t1 in self.marks if n.startswith(name)]

    def peak(self, t0: int = 0, t1: int = 2**63) -> tuple:
        """(peak live bytes within [t0, t1], the time it was reached)."""
        live, best = 0, (0, t0)
        for t, n, _, _ in self.events:
            if t > t1:
                break
            live += n
            if t >= t0 and live > best[0]:
                best = (live, t)
        return best

    def live_at(self, when: int, top: int = 10) -> list:
        """The largest groups (same label and size) live at time ``when``: ``[(label, bytes each, count)]``."""
        live = {}
        for t, n, ptr, label in self.events:
            if t > when:
                break
            if n > 0:
                live[ptr] = (label, n)
            else:
                live.pop(ptr, None)
        groups = {}
        for label, n in live.values():
            groups[(label, n)] = groups.get((label, n), 0) + 1
        return sorted(((label, n, c) for (label, n), c in groups.items()), key=lambda g: -g[1] * g[2])[:top]


def twin_peaks(timeline: AllocationTimeline, steps: list) -> tuple:
    """Each step's CPU peaks into ``steps``: ``peak_mib`` (its ``## step`` marks), ``before_peak_mib`` (since the last
    step; step 1: the set-up), ``forward`` / ``backward`` / ``optimizer_peak_mib``; returns the groups live at the
    highest step peak and at the set-up's (``[{label, each_mib, count}]``)."""
    forwards, opts = timeline.windows("## forward"), timeline.windows("Optimizer.step")
    best, setup, prev_end = (0, 0), (0, 0), 0
    for i, (step, (t0, t1)) in enumerate(zip(steps, timeline.windows("## step"))):
        peak, when = timeline.peak(t0, t1)
        step["peak_mib"] = peak / 2**20
        before = timeline.peak(prev_end, t0)
        step["before_peak_mib"] = before[0] / 2**20
        setup = before if i == 0 else setup
        prev_end = t1
        fwd = [w for w in forwards if t0 <= w[0] <= t1]
        opt = [w for w in opts if t0 <= w[0] <= t1]
        if fwd and opt:
            step["forward_peak_mib"] = timeline.peak(fwd[0][0], fwd[-1][1])[0] / 2**20
            step["backward_peak_mib"] = timeline.peak(fwd[-1][1], opt[0][0])[0] / 2**20
            step["optimizer_peak_mib"] = timeline.peak(opt[0][0], opt[-1][1])[0] / 2**20
        best = max(best, (peak, when))
    groups = [[{"label": label, "each_mib": n / 2**20, "count": c} for label, n, c in timeline.live_at(when, top=14)]
              for when in (best[1], setup[1])]
    return groups[0], groups[1]
