"""The opt-in memory report: it measures what the kernel really allocates (so it tells a fused kernel from
an unfused one), logs once, only when asked, and never touches CUDA's peak-memory counters."""

import pytest
import torch

from llamafactory_liger_fsdp.config import LigerFsdpConfig
from llamafactory_liger_fsdp.diagnostics import LiveBytes
from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.ops.torch_flce import fused_linear_cross_entropy_torch
from llamafactory_liger_fsdp.testing import make_batch, rel, twin


def test_live_bytes_counts_allocations_not_inputs_or_views():
    x = torch.randn(256, 256)
    with LiveBytes() as live:
        y = x[:128]  # a view of an input: nothing new
        z = torch.empty(1000, 1000)  # 4 MB
        del z
        w = torch.ones(500, 500) * 2  # 1 MB (+ 1 MB temporary)
        w.add_(1)
    assert live.peak >= 4_000_000 and live.peak < 4_000_000 + 2_100_000, live.peak
    assert 1_000_000 <= live.live <= 2_100_000, live.live
    assert y.shape == (128, 256)


def _peak(fn, *args):
    with LiveBytes() as live:
        fn(*args)
    return live.peak


def test_fused_and_unfused_are_told_apart():
    n, h, v = 256, 32, 4096
    hidden, weight = torch.randn(n, h), torch.randn(v, h)
    y = torch.randint(0, v, (n,))
    logits_bytes = n * v * 4
    unfused = _peak(lambda: torch.nn.functional.cross_entropy(hidden @ weight.t(), y))
    fused = _peak(lambda: fused_linear_cross_entropy_torch(hidden, weight, y, chunk_rows=16))
    assert unfused >= logits_bytes
    assert fused <= 16 * v * 4 * 3 < logits_bytes / 4  # a few [16, V] chunks at most


def _train_step(memory_report: bool):
    ref, cand = twin("llama", "mts")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", memory_report=memory_report))
    for step in range(2):
        cand(**make_batch(seed=step)).loss.backward()


def test_report_once_when_asked_and_counters_untouched(monkeypatch, capsys):
    def forbidden(*a, **k):
        raise AssertionError("the CUDA peak-memory counters were touched")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", forbidden)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", forbidden)
    _train_step(memory_report=False)
    assert "[liger_fsdp] memory" not in capsys.readouterr().err
    _train_step(memory_report=True)
    lines = [l for l in capsys.readouterr().err.splitlines() if "[liger_fsdp] memory" in l]
    assert len(lines) == 1, lines
    assert "(forward " in lines[0] and ", backward " in lines[0]
    assert "the unfused logits of these 24 tokens" in lines[0]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_report_does_not_change_the_numbers(kind):
    ref, cand = twin("qwen2", kind)
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", memory_report=True))
    batch = make_batch()
    lr, lc = ref(**batch).loss, cand(**batch).loss
    lr.backward(), lc.backward()
    assert lc.item() == pytest.approx(lr.item(), rel=1e-6)
    for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
        if p.requires_grad:
            assert rel(q.grad, p.grad) <= 1e-5, n


def _memory_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "[liger_fsdp] memory" in line]


@pytest.mark.parametrize("shifted", [False, True])
def test_report_on_the_log_probs_path(capsys, shifted):
    """The preference stages' and v1's call (``forward.token_logps``; ``shifted``: a sequence-parallel shard's, as
    v1's CP loss asks): the report measures the first call with gradients -- not a no-gradient call before it (the
    guard's sides, a reference pass) -- once."""
    from llamafactory_liger_fsdp import forward
    from llamafactory_liger_fsdp.engage import causal_lm_of

    _, cand = twin("llama", "mts")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", memory_report=True), any_head=True,
           request_only=True)
    cand.train()
    batch = make_batch(seed=1)
    labels = batch.pop("labels")
    with torch.no_grad():
        forward.token_logps(cand, causal_lm_of(cand), batch, labels, sums=False, shifted=shifted)
    assert _memory_lines(capsys) == []
    for _ in range(2):
        logps, _, _ = forward.token_logps(cand, causal_lm_of(cand), batch, labels, sums=True, shifted=shifted)
        logps.sum().backward()
    lines = _memory_lines(capsys)
    assert len(lines) == 1 and "(forward " in lines[0] and ", backward " in lines[0], lines
    assert f"the unfused logits of these {labels.numel()} tokens" in lines[0], lines


def test_report_on_v1s_compute_log_probs(capsys):
    """v1 (kernel_config.liger_fsdp_memory_report): through v1's own kernel registry and BaseTrainer.compute_log_probs,
    the report prints once."""
    pytest.importorskip("llamafactory.v1")
    from test_v1 import apply_kernel, build, sft_loss, v1_batch

    from llamafactory_liger_fsdp import engage as engage_module
    from llamafactory_liger_fsdp.integration.v1 import engine as v1

    model = build("mts")
    apply_kernel(model, {"name": "liger_fsdp", "liger_fsdp_guard": False, "liger_fsdp_memory_report": True,
                         "liger_fsdp_backend": "torch"})
    try:
        model.train()
        for step in range(2):
            _, loss = sft_loss(model, v1_batch(seed=step), step=step + 1)
            loss.backward()
        lines = _memory_lines(capsys)
        assert len(lines) == 1 and ", backward " in lines[0], lines
    finally:
        engage_module.disengage(model)
        v1._RUN["config"] = None
