"""QLoRA (issue 12 item 4), one device: a bitsandbytes 4-bit / 8-bit body with a trained, unquantized head
(transformers keeps the output embedding out of quantization) is exact, for a modules_to_save head and a LoRA
head; a quantized head stays refused. Skipped where bitsandbytes is not installed (it is not in
requirements-cpu.txt; bitsandbytes 0.50.2's CPU backend runs these)."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from llamafactory_liger_fsdp.config import LigerFsdpConfigError  # noqa: E402
from llamafactory_liger_fsdp.engage import engage  # noqa: E402
from llamafactory_liger_fsdp.testing import make_batch, make_model, make_peft, rel  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_model("llama").save_pretrained(path)
    return path


def _load(path, bits, skip=None):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_type="nf4",
                            llm_int8_skip_modules=skip) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip))
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.float32, device_map="cpu")


@pytest.mark.parametrize("kind", ["mts", "lora"])
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_exact(saved, bits, kind):
    ref, cand = make_peft(_load(saved, bits), kind), make_peft(_load(saved, bits), kind)
    assert type(cand.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ in ("Linear4bit", "Linear8bitLt")
    ref.train(), cand.train()
    engage(cand, backend="torch")
    batch = make_batch()
    lr, lc = ref(**batch).loss, cand(**batch).loss
    assert abs(lr.item() - lc.item()) <= 1e-5 * lr.item()
    lr.backward(), lc.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), cand.named_parameters()):
        if p.requires_grad:
            assert rel(q.grad, p.grad) <= 1e-5, n


def test_quantized_head_refused(saved):
    model = make_peft(_load(saved, 4, skip=["nothing"]), "lora")  # the head quantized too
    with pytest.raises(LigerFsdpConfigError, match="quantized heads are not supported"):
        engage(model, backend="torch")
