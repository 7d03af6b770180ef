"""The real Triton kernel (CPU, TRITON_INTERPRET=1 from conftest) against a float64 reference and
against plain torch on the same inputs: every loop path of the tiling, exactness in bf16/fp16,
large logits, the memory the lean path really allocates, the forward-only path, determinism.

Bounds chosen for the low-precision tests (CPU; plain torch = logits from one matmul in the input
dtype, fp32 loss, autograd): the returned dX/dW are rounded to bf16/fp16 once, so no kernel can
beat ``floor = rel(ref.to(dtype), ref)``; ours must stay within 5% of it. On the CPU plain torch
is 1.1-1.5x that floor in general (its CPU bf16 GEMMs reduce in fp32), so "0.6x plain torch" is
asserted where plain torch carries the errors this kernel removes: ``1/n_valid`` rounded into dz
(n_valid = 255), small probabilities underflowing in fp16, and per-row grad_output rounded into
dz's target entry."""

import pytest
import torch
from support.kernel import StorageTrace, inputs, plain_torch, reference, run

from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy, triton_common, triton_kernels, triton_lean
from llamafactory_liger_fsdp.ops.triton_flce import fused_linear_cross_entropy_triton
from llamafactory_liger_fsdp.ops.triton_lean import lean_bytes, plan_tiles
from llamafactory_liger_fsdp.testing import rel

TILES = [None, (7, 16, 5), (64, 64, 9), (3, 1000, 100)]  # (c, v_s, R): None planned; others: R < N_v, many slabs


def _triton(h, w, y, **kw):
    return fused_linear_cross_entropy_triton(h, w, y, **kw)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize(
    "reduction,softcap,label_smoothing", [("mean", None, 0.0), ("sum", 2.5, 0.0), ("none", 2.5, 0.1), ("mean", None, 0.2)]
)
def test_fp32_every_tiling(tiles, reduction, softcap, label_smoothing, fast):
    h, w, y = inputs(53, 24, 203, torch.float32, seed=3)
    g = torch.randn(53, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    loss, dh, dw = run(_triton, h, w, y, grad_rows=g, reduction=reduction, softcap=softcap,
                       label_smoothing=label_smoothing, tiles=tiles, fast=fast)
    ref_loss, ref_dh, ref_dw = reference(h, w, y, reduction=reduction, softcap=softcap,
                                         label_smoothing=label_smoothing, grad_rows=g)
    assert rel(loss, ref_loss) <= 1e-6
    assert rel(dh, ref_dh) <= 1e-6 and rel(dw, ref_dw) <= 1e-6


def _errors(dtype, shape, reduction, backend, seed=5, ignore=0.25, scale=1.0, grad_rows=None, label_smoothing=0.0):
    h, w, y = inputs(*shape, dtype, seed=seed, ignore=ignore, scale=scale)
    kw = {"reduction": reduction, "grad_rows": grad_rows, "label_smoothing": label_smoothing}
    ref_loss, ref_dh, ref_dw = reference(h, w, y, **kw)
    loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, backend=backend, **kw)
    _, t_dh, t_dw = plain_torch(h, w, y, **kw)
    assert dh.dtype == dtype and dw.dtype == dtype
    assert rel(loss, ref_loss) <= 1e-6  # fp32 logits and accumulation
    return {
        "ours": (rel(dh, ref_dh), rel(dw, ref_dw)),
        "floor": (rel(ref_dh.to(dtype), ref_dh), rel(ref_dw.to(dtype), ref_dw)),
        "torch": (rel(t_dh, ref_dh), rel(t_dw, ref_dw)),
    }


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["mean", "sum", "none", "smooth"])
def test_low_precision_at_the_rounding_floor(dtype, case, backend):
    """dX, dW within 5% of the error of rounding the float64 gradient itself, and below plain torch's
    (for "none", grad_output per row in [0.1, 3.1))."""
    g = torch.rand(96, generator=torch.Generator().manual_seed(0)) * 3 + 0.1 if case == "none" else None
    e = _errors(dtype, (96, 64, 1000), "mean" if case == "smooth" else case, backend, grad_rows=g,
                label_smoothing=0.1 if case == "smooth" else 0.0)
    for ours, floor, plain in zip(e["ours"], e["floor"], e["torch"]):
        assert ours <= 1.05 * floor and ours <= plain, e


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
@pytest.mark.parametrize(
    "dtype,shape,reduction,ignore,scale",
    [
        (torch.bfloat16, (255, 32, 512), "mean", 0.0, 1.0),  # 1/255 is 0.4% off in bf16: plain torch's dz carries it
        (torch.float16, (600, 16, 2000), "mean", 0.0, 1.5),  # p / n_valid underflows in fp16 in plain torch
    ],
)
def test_at_most_0_6_of_plain_torch(dtype, shape, reduction, ignore, scale, backend):
    e = _errors(dtype, shape, reduction, backend, seed=2, ignore=ignore, scale=scale)
    for ours, floor, plain in zip(e["ours"], e["floor"], e["torch"]):
        assert ours <= 0.6 * plain and ours <= 1.05 * floor, e


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("tiles", [None, (32, 512, 64)])
def test_large_logits_fp32(tiles, fast):
    """Logits of std ~100: forward and backward see bitwise the same logits (same GEMM tiles), and
    softmax = exp(z - max) / sum as torch computes it; within 1.2x of fp32 plain torch."""
    h, w, y = inputs(200, 64, 3000, torch.float32, seed=1, scale=100.0)
    ref_loss, ref_dh, ref_dw = reference(h, w, y)
    t_loss, t_dh, t_dw = plain_torch(h, w, y)
    loss, dh, dw = run(_triton, h, w, y, tiles=tiles, fast=fast)
    assert rel(loss, ref_loss) <= 1.2 * rel(t_loss, ref_loss) + 1e-7
    assert rel(dh, ref_dh) <= 1.2 * rel(t_dh, ref_dh) and rel(dw, ref_dw) <= 1.2 * rel(t_dw, ref_dw)


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
def test_grad_output_rounded_once(backend):
    """grad_output 3.7 (3.703125 in bf16) multiplies the fp32 gradients before their one rounding."""
    h, w, y = inputs(96, 64, 1000, torch.bfloat16, seed=6)
    _, ref_dh, ref_dw = reference(h, w, y)
    h.grad = w.grad = None
    (3.7 * fused_linear_cross_entropy(h, w, y, backend=backend)).backward()
    for got, ref in ((h.grad, 3.7 * ref_dh), (w.grad, 3.7 * ref_dw)):
        assert rel(got, ref) <= 1.05 * rel(ref.to(torch.bfloat16), ref)


@pytest.mark.parametrize("softcap,eps", [(None, 0.0), (2.5, 0.1)])
def test_statistics_pass_against_torch(softcap, eps):
    """``chunk_stats`` (one exp per logit, the target logit loaded once per row) against torch in float64 on rows
    that stress the running max: the max first, last, repeated (ties), a huge spread, one column past a block, a
    constant row; labels at both ends of the vocabulary."""
    g = torch.Generator().manual_seed(11)
    v = 2049  # one column past the interpreter's 2048-wide block
    z = torch.randn(6, v, generator=g, dtype=torch.float64) * 4
    z[0, 0] = 60.0  # max in the first column
    z[1, -1] = 60.0  # max in the last
    z[2, ::7] = 9.0  # the max repeated
    z[3] = torch.linspace(-500, 80, v, dtype=torch.float64)  # exp underflows over most of the row
    z[4] = 1.5  # constant
    z = z.float()
    y = torch.tensor([0, v - 1, 7, 1000, 3, 2048])
    m, s, t, zs = triton_kernels.chunk_stats(z, y, softcap, eps)
    zc = z.double() if softcap is None else softcap * torch.tanh(z.double() / softcap)
    ref_m = zc.max(dim=1).values
    assert rel(m, ref_m) <= 1e-7
    assert rel(torch.log(s.double()) + m.double(), torch.logsumexp(zc, dim=1)) <= 1e-7
    assert rel(t, zc[torch.arange(6), y]) <= 1e-7
    if eps:
        assert rel(zs, zc.sum(dim=1)) <= 1e-6
    else:
        assert zs is None


def test_no_ignored_and_single_row():
    for n in (1, 17):
        h, w, y = inputs(n, 16, 33, torch.float32, ignore=0.0)
        loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, backend="triton")
        ref_loss, ref_dh, ref_dw = reference(h, w, y)
        assert rel(loss, ref_loss) <= 1e-6 and rel(dh, ref_dh) <= 1e-6 and rel(dw, ref_dw) <= 1e-6


@pytest.mark.parametrize("fast", [False, True])
def test_deterministic_and_retain_graph(fast):
    outs = []
    for _ in range(2):
        h, w, y = inputs(40, 32, 300, torch.bfloat16, seed=9)
        loss = _triton(h, w, y, tiles=(16, 64, 16), fast=fast)
        loss.backward(retain_graph=True)
        first = (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
        loss.backward()  # the saved fp32 gradients are not consumed by the first backward
        assert torch.equal(first[0], h.grad) and torch.equal(first[1], w.grad)
        outs.append((loss.detach(), h.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_lean_memory_within_budget(monkeypatch, reduction):
    """Live bytes the lean forward and backward really allocate (every aten op's new storages, the
    returned gradients excluded), under a budget that forces small tiles: within the budget."""
    n, h_dim, v = 300, 32, 1000
    h, w, y = inputs(n, h_dim, v, torch.bfloat16, seed=7)
    n_valid = int((y != -100).sum())
    monkeypatch.setattr(triton_lean, "MIN_TILE", 16)
    budget = lean_bytes(n_valid, h_dim, 128, 64, need_h=True, need_w=True, gather=True, row_scaled=reduction == "none")
    v_s, r = plan_tiles(n_valid, h_dim, v, row_scaled=reduction == "none", mem_budget=budget)
    assert v_s < v and r < n_valid  # the budget does constrain the tiles
    g = torch.rand(n) + 0.5 if reduction == "none" else None
    fwd, bwd = StorageTrace(), StorageTrace()
    fwd.emulate_gpu(monkeypatch, triton_common)
    with fwd:
        loss = fused_linear_cross_entropy_triton(h, w, y, reduction=reduction, mem_budget=budget)
    bwd.emulate_gpu(monkeypatch, triton_common)
    with bwd:
        loss.backward(g)
    assert 0 < fwd.peak() <= budget
    assert 0 < bwd.peak(exclude=(h.grad, w.grad)) <= budget, (bwd.peak(exclude=(h.grad, w.grad)), budget)
    ref = reference(h, w, y, reduction=reduction, grad_rows=g)
    assert rel(h.grad, ref[1]) <= 1.05 * rel(ref[1].bfloat16(), ref[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("scatter", [False, True])
def test_scale_cast_is_torch_mul_bitwise(dtype, per_row, scatter):
    """The final ``grad * scale`` rounding of every path: the same bits as ``torch.mul(src, scale, out=dst)``, ties to
    even included, rows scattered into zeros where labels were ignored."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(37, 70, generator=g) * torch.logspace(-6, 6, 70)
    src[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2.0**-140])  # bf16 ties; a subnormal
    scale = torch.rand(37, generator=g) + 0.5 if per_row else torch.tensor(0.37)
    rows = torch.randperm(50, generator=g)[:37] if scatter else None
    out = triton_kernels.scale_cast(src, scale, torch.zeros(50 if scatter else 37, 70, dtype=dtype), rows)
    want = torch.zeros_like(out)
    prod = torch.mul(src, scale.unsqueeze(1) if per_row else scale).to(dtype)
    if scatter:
        want[rows] = prod
    else:
        want = prod
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


class _SyncLog:
    """Records host syncs (``tolist``, ``item``, ``bool``/``int`` of a tensor, ``nonzero``, ``unique_consecutive``)
    and the fp32 GEMMs of the kernel, in order."""

    SYNCS = [(torch.Tensor, n) for n in ("tolist", "item", "__bool__", "__int__", "nonzero")] + [
        (torch, "unique_consecutive")]

    def __init__(self, monkeypatch):
        self.events, self.on = [], False
        for owner, name in self.SYNCS:
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), "sync:" + name))
        for name in ("mm_f32", "addmm_f32_"):
            monkeypatch.setattr(triton_common, name, self._wrap(getattr(triton_common, name), "mm"))

    def _wrap(self, fn, tag):
        def logged(*a, **k):
            if self.on:
                self.events.append(tag)
            return fn(*a, **k)
        return logged

    def phase(self, fn):
        self.events, self.on = [], True
        try:
            out = fn()
        finally:
            self.on = False
        return out, list(self.events)


@pytest.mark.parametrize("path", ["fast", "lean", "rows"])
def test_no_host_sync_after_the_gemms_are_queued(monkeypatch, path):
    """Each phase's host syncs (the valid rows, the target term's index and slab bounds) come before its first GEMM,
    so the GPU does not idle while the host catches up after the big matmuls (H200, 16k x 4096 x 128k: a 3 ms gap at
    the start of backward when the index was built after them)."""
    h, w, y = inputs(60, 16, 90, torch.bfloat16, seed=4)
    h.requires_grad_(), w.requires_grad_()
    log = _SyncLog(monkeypatch)
    kw = {"fast": path != "lean", "reduction": "none" if path == "rows" else "mean", "tiles": (16, 32, 16)}
    loss, fwd = log.phase(lambda: fused_linear_cross_entropy_triton(h, w, y, **kw))
    _, bwd = log.phase(lambda: loss.sum().backward())
    for events in (fwd, bwd):
        first_mm = events.index("mm") if "mm" in events else len(events)
        assert all(not e.startswith("sync") for e in events[first_mm:]), events
    # one sync reads every size the labels decide (ops.labels.scan_labels); the lean path's slab, planned from
    # n_valid, adds its slab bounds; the per-row path's backward asks whether grad_output is uniform
    assert [e for e in fwd if e.startswith("sync")] == ["sync:tolist"] * (2 if path == "lean" else 1), fwd
    assert [e for e in bwd if e.startswith("sync")] == (["sync:__bool__"] if path == "rows" else []), bwd
    assert "mm" in fwd and h.grad is not None and w.grad is not None


def test_fast_memory_model(monkeypatch):
    """triton_fast holds fp32 dh [N_v, H] and dW [V, H] plus one chunk of fp32 logits, dz written over them."""
    n, h_dim, v = 200, 32, 500
    h, w, y = inputs(n, h_dim, v, torch.bfloat16, seed=8)
    n_valid = int((y != -100).sum())
    c = 32
    fwd = StorageTrace()
    fwd.emulate_gpu(monkeypatch, triton_common)
    with fwd:
        loss = fused_linear_cross_entropy_triton(h, w, y, fast=True, tiles=(c, 0, 0))
    # + per-row vectors: lse, loss, target logit, indices and the target term's sorted index (built before the GEMMs)
    model = 4 * n_valid * h_dim + 4 * v * h_dim + 4 * c * v + 2 * c * h_dim + 96 * n_valid
    assert 4 * v * h_dim < fwd.peak() <= model
    loss.backward()


def test_fast_per_row_keeps_dz(monkeypatch):
    """triton_fast with reduction="none" (per-token log-probs): forward keeps the 16-bit dz [N_v, V] and fp32 dh
    [N_v, H] plus one chunk of fp32 logits, 6 N_v H V flops in all (the lean path: 8); above FAST_STORE_MAX_BYTES
    the lean path runs, with the same gradients."""
    from llamafactory_liger_fsdp.ops import triton_rows

    n, h_dim, v, c = 200, 32, 500, 32
    h, w, y = inputs(n, h_dim, v, torch.bfloat16, seed=8)
    n_valid = int((y != -100).sum())
    g = torch.rand(n, generator=torch.Generator().manual_seed(2)) * 3 + 0.1
    grads = {}
    for store in (True, False):
        monkeypatch.setattr(triton_rows, "FAST_STORE_MAX_BYTES", 2 * n_valid * v if store else 2 * n_valid * v - 1)
        monkeypatch.setattr(triton_common, "default_chunk", lambda _v: c)
        track = StorageTrace()
        track.emulate_gpu(monkeypatch, triton_common)
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with track:
            loss = fused_linear_cross_entropy(hh, ww, y, backend="triton_fast", reduction="none")
        assert (loss.grad_fn._forward_cls is triton_rows._StoredDzFLCE) == store
        if store:
            model = 2 * n_valid * v + 4 * n_valid * h_dim + 4 * c * v + 2 * c * h_dim + 96 * n_valid
            assert 2 * n_valid * v < track.peak() <= model, (track.peak(), model)
        with track:
            loss.backward(g)
        assert track.mm_flops == (6 if store else 8) * n_valid * h_dim * v
        grads[store] = (hh.grad, ww.grad)
    ref = reference(h, w, y, reduction="none", grad_rows=g)
    for store in (True, False):
        assert rel(grads[store][0], ref[1]) <= 1.05 * rel(ref[1].bfloat16(), ref[1])
        assert rel(grads[store][1], ref[2]) <= 1.05 * rel(ref[2].bfloat16(), ref[2])


@pytest.mark.parametrize("path", ["lean", "fast", "rows"])
def test_frozen_weight_columns_at_the_rounding_floor(monkeypatch, path):
    """bf16, a LoRA head's shape ([W, B] with W frozen): dW only for B's columns -- 2 N_v H_B V flops instead of
    2 N_v H V (4 N_v H V + that in all, 2 N_v H V more on the lean path) -- and dh, dB at the rounding floor."""
    n, h_f, h_t, v = 96, 32, 8, 300
    h, w_all, y = inputs(n, h_f + h_t, v, torch.bfloat16, seed=6)
    frozen, w = w_all.detach()[:, :h_f].contiguous(), w_all.detach()[:, h_f:].clone().requires_grad_()
    n_valid = int((y != -100).sum())
    reduction = "none" if path == "rows" else "mean"
    g = torch.rand(n, generator=torch.Generator().manual_seed(4)) + 0.5 if path == "rows" else None
    track = StorageTrace()
    track.emulate_gpu(monkeypatch, triton_common)
    with track:
        loss, dh, dw = run(fused_linear_cross_entropy, h, w, y, grad_rows=g, reduction=reduction,
                           backend="triton" if path == "lean" else "triton_fast", frozen_weight=frozen)
    hv = n_valid * (h_f + h_t) * v
    assert track.mm_flops == (6 if path == "lean" else 4) * hv + 2 * n_valid * h_t * v
    ref = reference(h, w_all, y, reduction=reduction, grad_rows=g)
    assert rel(loss, ref[0]) <= 1e-6
    assert rel(dh, ref[1]) <= 1.05 * rel(ref[1].bfloat16(), ref[1])
    assert rel(dw, ref[2][:, h_f:]) <= 1.05 * rel(ref[2][:, h_f:].bfloat16(), ref[2][:, h_f:])


def test_fast_per_row_frozen_head_keeps_nothing(monkeypatch):
    """A frozen head (weight without grad: a DPO policy that trains only the body) with reduction="none": no dz is
    kept whatever its size (FAST_STORE_MAX_BYTES 0), 4 N_v H V flops, dh at the rounding floor."""
    from llamafactory_liger_fsdp.ops import triton_rows

    n, h_dim, v, c = 200, 32, 500, 32
    h, w, y = inputs(n, h_dim, v, torch.bfloat16, seed=9)
    n_valid = int((y != -100).sum())
    g = torch.rand(n, generator=torch.Generator().manual_seed(3)) * 3 + 0.1
    monkeypatch.setattr(triton_rows, "FAST_STORE_MAX_BYTES", 0)
    monkeypatch.setattr(triton_common, "default_chunk", lambda _v: c)
    track = StorageTrace()
    track.emulate_gpu(monkeypatch, triton_common)
    hh = h.detach().clone().requires_grad_()
    with track:
        loss = fused_linear_cross_entropy(hh, w.detach(), y, backend="triton_fast", reduction="none")
        assert loss.grad_fn._forward_cls is triton_rows._StoredDzFLCE
        assert track.peak() <= 4 * n_valid * h_dim + 4 * c * v + 2 * c * h_dim + 64 * n_valid + 8 * n
        loss.backward(g)
    assert track.mm_flops == 4 * n_valid * h_dim * v
    ref = reference(h, w, y, reduction="none", grad_rows=g)
    assert rel(hh.grad, ref[1]) <= 1.05 * rel(ref[1].bfloat16(), ref[1])


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_forward_only_when_no_gradient_is_needed(monkeypatch, fast, mode):
    """2 N_v H V flops and no gradient buffers: under no_grad, or when neither input requires grad."""
    n, h_dim, v = 64, 16, 300
    h, w, y = inputs(n, h_dim, v, torch.bfloat16, seed=1)
    n_valid = int((y != -100).sum())
    ref_loss = reference(h, w, y)[0]
    if mode == "inputs_without_grad":
        h, w = h.detach(), w.detach()
    log = StorageTrace()
    log.emulate_gpu(monkeypatch, triton_common)
    with log:
        if mode == "no_grad":
            with torch.no_grad():
                loss = fused_linear_cross_entropy(h, w, y, backend="triton_fast" if fast else "triton")
        else:
            loss = fused_linear_cross_entropy(h, w, y, backend="triton_fast" if fast else "triton")
    assert log.mm_flops == 2 * n_valid * h_dim * v
    assert log.peak() <= 4 * n_valid * v + 2 * n_valid * h_dim + 64 * n_valid  # at most one [N_v, V] fp32 tile
    grads = [a for a in log.allocated if a[2] == torch.float32 and a[1] in ((v, h_dim), (n_valid, h_dim))]
    assert not grads  # no fp32 gradient accumulators
    assert not loss.requires_grad and rel(loss, ref_loss) <= 1e-6


def test_plan_prefers_low_traffic_within_budget():
    # the real shapes of the benchmark, 25% ignored: tiles fit the default budget, never below 2048
    for n, h, v in [(8192, 4096, 128256), (16384, 4096, 128256), (16384, 3584, 152064), (8192, 3840, 262208)]:
        nv = n * 3 // 4
        v_s, r = plan_tiles(nv, h, v)
        mem = lean_bytes(nv, h, v_s, r, need_h=True, need_w=True, gather=True)
        assert mem <= triton_lean.DEFAULT_MEM_BUDGET and v_s >= 2048 and r >= 2048


# --------------------------------------------------------------------------- the fused logits GEMM (ops.triton_fused)
FUSED_SMALL = (32, 64, 32, 1, 1, 2, False)  # several row, column and K tiles on small shapes, GROUP_M edges


@pytest.fixture
def fused(monkeypatch):
    """``triton_fused`` forced on under the interpreter with small tiles; ``set(mode, lean)`` picks the paths;
    ``launches`` counts the kernel's launches by epilogue."""
    from llamafactory_liger_fsdp.ops import triton_fused

    monkeypatch.setattr(triton_fused, "FORCE", True)
    monkeypatch.setattr(triton_fused, "CONFIG", FUSED_SMALL)
    launches = []
    real = triton_fused._launch

    def counted(h, weight, epi, **kw):
        launches.append(epi)
        return real(h, weight, epi, **kw)

    monkeypatch.setattr(triton_fused, "_launch", counted)

    class Ctl:
        def set(self, mode, lean):
            monkeypatch.setattr(triton_fused, "RULES", [(1 << 30, mode, lean)])

    ctl = Ctl()
    ctl.launches = launches
    return ctl


@pytest.mark.parametrize("dtype,softcap,eps", [(torch.bfloat16, None, 0.0), (torch.float16, 2.5, 0.1)])
def test_fused_gemm_matches_cublas_and_the_passes(fused, dtype, softcap, eps):
    """Its z equals the fp32 GEMM of the 16-bit operands, its statistics the pass's over that z (with or without z
    stored), its dz bitwise the dz pass's (V = 1000: ragged last column tile; 45 rows: ragged last row tile)."""
    from llamafactory_liger_fsdp.ops import triton_fused

    h, w, _ = inputs(45, 96, 1000, dtype, seed=4)
    h, w = h.detach(), w.detach()
    y = torch.randint(0, 1000, (45,), generator=torch.Generator().manual_seed(2))
    y[:4] = torch.tensor([0, 255, 256, 999])
    z = torch.empty(45, 1000)
    stats = triton_fused.logits_stats(h, w, y, softcap, eps, z_out=z)
    ref_z = h.float() @ w.float().t()
    assert rel(z, ref_z) <= 1e-6
    want = triton_kernels.chunk_stats(ref_z, y, softcap, eps)
    for got, ref, again in zip(stats, want, triton_fused.logits_stats(h, w, y, softcap, eps)):
        assert (got is None and ref is None) or (rel(got, ref) <= 1e-6 and torch.equal(got, again))
    m, inv_s = stats[0], 1.0 / stats[1]
    dz, ref_dz = torch.empty(45, 1000, dtype=dtype), torch.empty(45, 1000, dtype=dtype)
    assert triton_fused.logits_dz(h, w, dz, m, inv_s, softcap, eps, 1000, 2.0**15 if dtype == torch.float16 else 1.0)
    triton_kernels.launch_dz(z, ref_dz, m, inv_s, softcap, eps, 1000, 2.0**15 if dtype == torch.float16 else 1.0)
    assert torch.equal(dz, ref_dz)


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("path,dtype,case", [
    ("lean", BF16, "mean"), ("lean", FP16, "sum"), ("lean", BF16, "smooth"), ("lean", FP16, "softcap"),
    ("lean", BF16, "none"), ("recompute", BF16, "mean"), ("recompute", FP16, "softcap"), ("stats", BF16, "smooth"),
])
def test_fused_paths_at_the_rounding_floor(monkeypatch, fused, path, dtype, case):
    """Each path through the fused GEMM (several chunks / tiles; the lean path as shipped, the fast path's two modes
    kept off by RULES): dX, dW within 5% of rounding the float64 gradient and below plain torch's, the loss at fp32;
    the fused kernel really ran."""
    from llamafactory_liger_fsdp.ops import triton_fused

    monkeypatch.setattr(triton_fused, "CONFIG", (64, 128, 32, 1, 1, 2, False))  # 2 row, 8 column, 2 K tiles
    fused.set(None if path == "lean" else path, path == "lean")
    g = torch.rand(96, generator=torch.Generator().manual_seed(0)) * 3 + 0.1 if case == "none" else None
    kw = {"reduction": "mean" if case in ("smooth", "softcap") else case, "grad_rows": g,
          "label_smoothing": 0.1 if case == "smooth" else 0.0, "softcap": 3.0 if case == "softcap" else None}
    h, w, y = inputs(96, 64, 1000, dtype, seed=5)
    ref_loss, ref_dh, ref_dw = reference(h, w, y, **kw)
    _, t_dh, t_dw = plain_torch(h, w, y, **kw)
    tiles = (16, 256, 32) if path == "lean" else (16, 0, 0)
    loss, dh, dw = run(_triton, h, w, y, tiles=tiles, fast=path != "lean", **kw)
    if case != "none" or path == "lean":  # "none" on the fast backend keeps dz (triton_rows), not the fused GEMM
        assert fused.launches and (2 in fused.launches) == (path != "stats")
    assert rel(loss, ref_loss) <= 1e-6
    for ours, ref, plain in ((dh, ref_dh, t_dh), (dw, ref_dw, t_dw)):
        assert rel(ours, ref) <= 1.05 * rel(ref.to(dtype), ref) and rel(ours, ref) <= rel(plain, ref)


def test_fused_forward_only_and_frozen_head(fused):
    """The forward alone (lean statistics, no gradient buffers) and a LoRA head ([W | B], W frozen) through it."""
    fused.set("recompute", True)
    h, w_all, y = inputs(80, 72, 1000, torch.bfloat16, seed=8)
    ref_loss, ref_dh, ref_dw = reference(h, w_all, y)
    with torch.no_grad():
        assert rel(fused_linear_cross_entropy(h, w_all, y, backend="triton"), ref_loss) <= 1e-6
    assert fused.launches == [0]
    frozen, b = w_all.detach()[:, :64].contiguous(), w_all.detach()[:, 64:].clone().requires_grad_()
    for backend in ("triton", "triton_fast"):
        h.grad = None
        fused_linear_cross_entropy(h, b, y, backend=backend, frozen_weight=frozen).backward()
        assert rel(h.grad, ref_dh) <= 1.05 * rel(ref_dh.bfloat16(), ref_dh)
        assert rel(b.grad, ref_dw[:, 64:]) <= 1.05 * rel(ref_dw[:, 64:].bfloat16(), ref_dw[:, 64:])
        b.grad = None
    assert fused.launches.count(2) >= 2


def test_fused_used_only_where_it_runs(monkeypatch):
    """Not on the CPU without FORCE, not for fp32 or unaligned rows (H % 8, V % 8), not after a compile failure; no
    rule, no use."""
    from llamafactory_liger_fsdp.ops import triton_fused

    h, w, _ = inputs(16, 64, 1000, torch.bfloat16)
    h, w = h.detach(), w.detach()
    with monkeypatch.context() as m:  # as shipped: the lean path up to H 4096, the fast path never
        m.setattr(triton_fused, "FORCE", True)
        wide = torch.zeros(8, 8192, dtype=torch.bfloat16)
        assert triton_fused.mode_for(h, w) == (None, True) and triton_fused.mode_for(wide, wide) == (None, False)
    monkeypatch.setattr(triton_fused, "RULES", [(4096, "recompute", True)])
    assert not triton_fused.usable(h, w) and triton_fused.mode_for(h, w) == (None, False)
    monkeypatch.setattr(triton_fused, "FORCE", True)
    assert triton_fused.mode_for(h, w) == ("recompute", True)
    assert not triton_fused.usable(h.float(), w.float())
    assert not triton_fused.usable(inputs(16, 60, 1000, torch.bfloat16)[0].detach(),
                                   inputs(16, 60, 1000, torch.bfloat16)[1].detach())
    assert not triton_fused.usable(h, w[:996])
    monkeypatch.setattr(triton_fused, "RULES", [(32, "recompute", True)])
    assert triton_fused.mode_for(h, w) == (None, False)
    monkeypatch.setattr(triton_fused, "_failed", ["CompilationError: x"])
    assert not triton_fused.usable(h, w)
