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
