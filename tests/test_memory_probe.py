"""The step-1 memory report: measured around the kernel only, forward and backward, rank 0, once.
CUDA's counters are replaced by a fake allocator clock so the logic runs on the CPU."""

import torch

from llamafactory_liger_fsdp import head
from llamafactory_liger_fsdp.ops import fused_linear_cross_entropy


def test_probe_reports_forward_and_backward(monkeypatch, capsys):
    state = {"alloc": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: state.update(peak=state["alloc"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: state["alloc"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: state["peak"])

    def kernel(h, w, y):
        state["peak"] = state["alloc"] + 3 * 2**30  # the kernel's forward working set

        class Spy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                state["peak"] = state["alloc"] + 2**30 + grad_bytes  # backward working set + returned grads
                return g

        return fused_linear_cross_entropy(Spy.apply(h), w, y, backend="torch")

    h = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    y = torch.randint(0, 10, (8,))
    grad_bytes = h.numel() * 4 + w.numel() * 4
    probe = head._MemoryProbe(vocab=10)
    loss = probe.run(kernel, h, w, y)
    loss.backward()
    err = capsys.readouterr().err
    assert "[liger_fsdp] memory (step 1, measured): the fused loss kernel needed 3.00 GiB beyond its inputs and gradients" in err
    assert "(forward 3.00 GiB, backward 1.00 GiB)" in err
    assert "unfused logits for these 8 tokens" in err
    assert err.count("[liger_fsdp] memory") == 1
