"""QLoRA: a bitsandbytes 4-bit / 8-bit body with a trained, unquantized head (transformers
keeps the output embedding out of quantization) is exact on one device (modules_to_save and LoRA heads) and under
FSDP2 on 2 gloo ranks (4-bit with ``bnb_4bit_quant_storage`` fp32, as LLaMA-Factory's fsdp_qlora example sets
it; this file is its own worker); a quantized head stays refused. Skipped where bitsandbytes is not installed (it
is not in requirements-cpu.txt; bitsandbytes 0.50.2's CPU backend runs these)."""

import sys

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from support.dist import every_rank, launch, spawn  # noqa: E402

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
                            bnb_4bit_quant_storage=torch.float32, llm_int8_skip_modules=skip) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip))
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


@pytest.mark.parametrize("kind", ["mts", "lora"])
def test_quantized_head_refused(saved, kind):
    model = make_peft(_load(saved, 4, skip=["nothing"]), kind)  # the head quantized too (its storage float32)
    with pytest.raises(LigerFsdpConfigError, match="quantized heads are not supported"):
        engage(model, backend="torch")


def _rank(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llamafactory_liger_fsdp import wrapping

    ref, cand = make_peft(_load(path, 4), "mts"), make_peft(_load(path, 4), "mts")
    ref.train(), cand.train()
    engage(cand, backend="torch")
    mesh = init_device_mesh("cpu", (world,))
    wrapping.shard_marked_units(cand, mesh=mesh)
    for layer in cand.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(cand, mesh=mesh)
    batches = [make_batch(seed=r) for r in range(world)]
    sum(ref(**b).loss / world for b in batches).backward()
    loss = cand(**batches[rank]).loss
    loss.backward()
    named = dict(ref.named_parameters())
    grads = {n: rel(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, named[n].grad)
             for n, p in cand.named_parameters() if p.grad is not None}
    return dict(loss_rel=abs(loss.item() - ref(**batches[rank]).loss.item()) / loss.item(), grads=grads)


@pytest.mark.slow
def test_qlora_fsdp2_two_ranks(saved, tmp_path):
    out = tmp_path / "out.json"
    proc = launch(__file__, saved, out, timeout=600)  # this file is its own launcher (below)
    ranks = every_rank(proc, out)
    assert "guard: step 1 exact" in proc.stderr, proc.stderr[-6000:]
    for result in ranks:
        assert result["loss_rel"] <= 1e-5 and len(result["grads"]) > 20, result
        assert max(result["grads"].values()) <= 1e-5, result


if __name__ == "__main__":
    spawn(_rank, (sys.argv[1],), out=sys.argv[2])
