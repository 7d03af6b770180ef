"""v1's FSDP2 layer finder (integration/v1/layers.py), in process: patched only for a model whose decoder layers the
installed finder misses (LLaMA-Factory 0.9.5 + transformers 5 + a PeftModel), answering in the finder's own shape, a
no-op for a model it finds (a plain causal LM; git main's set-valued finder) and undone on disengage. The end-to-end
runs (losses, weights, the units counted on the live model) are tests/test_v1_dist.py's."""

import pytest

pytest.importorskip("llamafactory.v1")

from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from llamafactory_liger_fsdp import announce, engage  # noqa: E402
from llamafactory_liger_fsdp.integration.v1 import layers  # noqa: E402
from llamafactory_liger_fsdp.testing import make_model  # noqa: E402


def _git_main_finder(model):  # git main's rule and shape: a set of classes
    return layers.layer_classes(model)


def test_patched_only_where_the_finder_misses():
    causal_lm = make_model("llama")
    layer_cls = type(causal_lm.model.layers[0])
    original = fsdp2.get_transformer_layer_cls
    layers.patch(causal_lm)  # a plain causal LM: 0.9.5 finds model.model.layers
    assert fsdp2.get_transformer_layer_cls is original and announce.NOTES not in causal_lm.__dict__
    peft_model = get_peft_model(causal_lm, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert not layers.misses(_git_main_finder, peft_model)  # git main: nothing to patch
    if not layers.misses(original, peft_model):
        pytest.skip("the installed v1 finds a PeftModel's decoder layers")
    layers.patch(peft_model)
    try:
        assert fsdp2.get_transformer_layer_cls(peft_model) is layer_cls  # 0.9.5's shape: one class
        assert fsdp2.get_transformer_layer_cls(causal_lm) is original(causal_lm)
        (clause,) = causal_lm.__dict__[announce.NOTES]
        assert "each decoder layer made a unit" in clause(causal_lm) and f"(0 of {len(causal_lm.model.layers)} are" in clause(causal_lm)
    finally:
        engage.disengage(peft_model)
    assert fsdp2.get_transformer_layer_cls is original and announce.NOTES not in causal_lm.__dict__


def test_answer_keeps_a_set_finder_shape():
    peft_model = get_peft_model(make_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    other = type("Vision", (), {})
    assert layers._answer({other}, peft_model) == {other} | layers.layer_classes(peft_model)
