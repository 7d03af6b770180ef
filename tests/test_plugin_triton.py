"""The plugin's loss through the real Triton kernel (CPU, TRITON_INTERPRET=1 from conftest): loss and
every trainable gradient equal the unfused model's, both Triton backends."""

import pytest
import torch

from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.testing import make_batch, rel, twin


@pytest.mark.parametrize("backend", ["triton", "triton_fast"])
@pytest.mark.parametrize("case", [("llama", "mts"), ("llama", "lora"), ("gemma2", "full"), ("qwen2_tied", "full")])
def test_plugin_through_triton(case, backend):
    family, kind = case
    ref, cand = twin(family, kind)
    engage(cand, backend=backend)
    batch = make_batch()
    n_t = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()) * 2)
    lr, lc = ref(**batch, num_items_in_batch=n_t).loss, cand(**batch, num_items_in_batch=n_t).loss
    lr.backward(), lc.backward()
    assert abs(lr.item() - lc.item()) <= 1e-5 * lr.item()
    for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
        if p.requires_grad:
            assert rel(q.grad, p.grad) <= 1e-5, n


