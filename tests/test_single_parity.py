"""One device: loss and every trainable gradient of the engaged model equal the unfused model's,
for every supported family and head kind, with softcap, MoE aux loss, LoRA dropout and gradient
accumulation (``num_items_in_batch``)."""

import pytest
import torch

from llamafactory_liger_fsdp.config import LigerFsdpConfig
from llamafactory_liger_fsdp.engage import disengage, engage, engaged
from llamafactory_liger_fsdp.testing import FAMILY_CONFIGS, make_batch, rel, twin

TOL = 1e-5


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _compare(ref, cand, atol_rel=TOL):
    gr, gc = _grads(ref), _grads(cand)
    assert gr.keys() == gc.keys()
    for n in gr:
        assert gr[n] is not None and gc[n] is not None, n
        assert rel(gc[n], gr[n]) <= atol_rel, (n, rel(gc[n], gr[n]))


@pytest.mark.parametrize("kind", ["mts", "lora", "full"])
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_family_parity(family, kind):
    ref, cand = twin(family, kind)
    ref.train(), cand.train()
    done = engage(cand, backend="torch")
    assert done is not None and done.head.kind == {"mts": "modules_to_save", "lora": "lora", "full": "full"}[kind]
    batch = make_batch()
    out_ref = ref(**batch)
    out = cand(**batch)
    assert out.logits is None  # the N x V logits never exist
    assert abs(out.loss.item() - out_ref.loss.item()) <= TOL * abs(out_ref.loss.item())
    out_ref.loss.backward()
    out.loss.backward()
    _compare(ref, cand)


def test_softcap_is_applied(monkeypatch):
    """Gemma 2's final-logit softcap (3.0 here) matters to the loss, and the fused loss applies it."""
    from llamafactory_liger_fsdp import families

    batch = make_batch()
    ref, cand = twin("gemma2", "full")
    engage(cand, backend="torch")
    assert abs(cand(**batch).loss.item() - ref(**batch).loss.item()) <= TOL * ref(**batch).loss.item()
    _, dropped = twin("gemma2", "full")
    monkeypatch.setattr(families, "softcap", lambda family, config: None)  # a planted wrong quirk
    engage(dropped, LigerFsdpConfig(enabled=True, backend="torch", guard=False))  # the guard would stop it
    assert abs(dropped(**batch).loss.item() - ref(**batch).loss.item()) > 1e-3


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_aux_loss_included(family):
    ref, cand = twin(family, "mts")
    engage(cand, backend="torch")
    batch = make_batch()
    out, out_ref = cand(**batch), ref(**batch)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    assert abs(out.aux_loss.item() - out_ref.aux_loss.item()) <= 1e-6
    lm_only = out.loss.item() - cand.base_model.model.router_aux_loss_coef * out.aux_loss.item()
    assert abs(lm_only - out_ref.loss.item()) > 1e-4  # the aux term is really part of the loss
    assert abs(out.loss.item() - out_ref.loss.item()) <= TOL * out_ref.loss.item()


def test_lora_head_delta_enters_loss():
    """The silent bug: a loss that reads lm_head.weight ignores the LoRA delta; ours does not."""
    ref, cand = twin("llama", "lora")
    done = engage(cand, backend="torch")
    batch = make_batch()
    loss = cand(**batch).loss
    loss.backward()
    lm = cand.base_model.model.lm_head
    base_only = torch.nn.functional.cross_entropy(
        (ref.base_model.model.model(input_ids=batch["input_ids"]).last_hidden_state @ lm.base_layer.weight.t())[:, :-1]
        .reshape(-1, lm.base_layer.weight.shape[0]),
        batch["labels"][:, 1:].reshape(-1),
    )
    assert abs(base_only.item() - loss.item()) > 1e-3
    assert abs(loss.item() - ref(**batch).loss.item()) <= TOL * loss.item()
    for name in ("lora_A", "lora_B"):
        g = getattr(lm, name)[done.head.adapter].weight.grad
        assert g is not None and g.abs().sum() > 0


@pytest.mark.parametrize("family", ["llama", "phi"])  # phi: the base layer has a (frozen) bias
def test_lora_head_differentiates_only_lora_b(family, monkeypatch):
    """The LoRA head hands the kernel its frozen columns (base weight, bias) as ``frozen_weight``: the weight it
    differentiates is lora_B's ``[V, r]`` alone; loss and every gradient still equal the unfused model's."""
    from llamafactory_liger_fsdp import ops

    seen = []
    real = ops.fused_linear_cross_entropy

    def spy(h, w, y, **kw):
        seen.append((tuple(w.shape), None if kw.get("frozen_weight") is None else tuple(kw["frozen_weight"].shape)))
        return real(h, w, y, **kw)

    monkeypatch.setattr(ops, "fused_linear_cross_entropy", spy)
    ref, cand = twin(family, "lora")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", guard=False))
    lm_head = cand.base_model.model.lm_head
    v, hidden = lm_head.base_layer.weight.shape
    r = lm_head.lora_B["default"].weight.shape[1]
    batch = make_batch()
    out_ref, out = ref(**batch), cand(**batch)
    assert seen == [((v, r), (v, hidden + (lm_head.base_layer.bias is not None)))]
    assert (lm_head.base_layer.bias is not None) == (family == "phi")
    assert abs(out.loss.item() - out_ref.loss.item()) <= TOL * abs(out_ref.loss.item())
    out_ref.loss.backward(), out.loss.backward()
    _compare(ref, cand)


def test_lora_dropout_same_mask():
    ref, cand = twin("qwen2", "lora", dropout=0.3)
    engage(cand, backend="torch")
    batch = make_batch()
    torch.manual_seed(7)
    lr = ref(**batch).loss
    torch.manual_seed(7)
    lc = cand(**batch).loss
    lr.backward(), lc.backward()
    assert abs(lr.item() - lc.item()) <= TOL * lr.item()
    _compare(ref, cand)


@pytest.mark.parametrize("kind", ["mts", "lora"])
def test_gradient_accumulation_num_items_in_batch(kind):
    """Two micro-batches normalised by the total token count, as transformers' Trainer does."""
    ref, cand = twin("llama", kind)
    engage(cand, backend="torch")
    micro = [make_batch(seed=1, ignore_frac=0.1), make_batch(seed=2, ignore_frac=0.6)]
    num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    n_t = torch.tensor(num_items)
    total_ref = total = 0.0
    for b in micro:
        lr_ = ref(**b, num_items_in_batch=n_t).loss
        lc_ = cand(**b, num_items_in_batch=n_t).loss
        assert abs(lr_.item() - lc_.item()) <= TOL * abs(lr_.item())
        lr_.backward(), lc_.backward()
        total_ref += lr_.item()
        total += lc_.item()
    # a mean per micro-batch would differ: the two micro-batches have very different token counts
    mean_ref = sum(twin("llama", kind)[0](**b).loss.item() for b in micro) / 2
    assert abs(mean_ref - total_ref) > 1e-3
    assert abs(total - total_ref) <= TOL * total_ref
    _compare(ref, cand)


def test_eval_mode_returns_logits():
    ref, cand = twin("llama", "mts")
    engage(cand, backend="torch")
    cand.eval(), ref.eval()
    batch = make_batch()
    with torch.no_grad():
        out, out_ref = cand(**batch), ref(**batch)
    assert out.logits is not None and torch.allclose(out.logits, out_ref.logits)


def test_bf16_within_rounding():
    ref, cand = twin("qwen2", "mts")
    ref.to(torch.bfloat16), cand.to(torch.bfloat16)
    engage(cand, backend="torch")
    batch = make_batch(batch=4, seq=32)
    lr, lc = ref(**batch).loss, cand(**batch).loss
    lr.backward(), lc.backward()
    assert abs(lr.item() - lc.item()) <= 1e-2 * lr.item()
    _compare(ref, cand, atol_rel=2e-2)


def test_frozen_head_does_not_engage(capsys):
    from llamafactory_liger_fsdp.testing import make_model
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert engage(model, backend="torch") is None
    assert "[liger_fsdp] not engaged: lm_head is frozen" in capsys.readouterr().err


def test_disengage_restores_forward():
    ref, cand = twin("llama", "full")
    engage(cand, backend="torch")
    assert "forward" in cand.__dict__
    disengage(cand)
    assert "forward" not in cand.__dict__ and engaged(cand) is None
    assert cand(**make_batch()).logits is not None


def test_engaged_line_names_the_backend_of_the_inputs_device():
    """Under parameter offload the weights sit on the CPU between calls while the kernel runs where the inputs are:
    the engaged line's backend follows the inputs (H100, v1 offload_params: it said `torch` for a `triton_fast` run)."""
    from llamafactory_liger_fsdp.announce import engaged_line

    _, cand = twin("llama", "full")
    done = engage(cand, config=LigerFsdpConfig(enabled=True))
    try:
        assert "backend=torch" in engaged_line(cand, done.seam, done.config)
        assert "backend=triton_fast" in engaged_line(cand, done.seam, done.config, torch.device("cuda"))
    finally:
        disengage(cand)
