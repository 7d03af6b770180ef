"""The frozen originals of PEFT's ``modules_to_save`` wrappers (``additional_target: embed_tokens,lm_head``) become
FSDP2 units of their own when the plugin engages (``wrapping.idle_originals``): a training step never gathers them (in the
root unit they were gathered for every forward and backward), the loss and gradients stay the unsharded model's, and a
reference pass under ``disable_adapter()`` (DPO) still reads them. One gloo rank in this process."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from llamafactory_liger_fsdp import wrapping
from llamafactory_liger_fsdp.config import LigerFsdpConfig
from llamafactory_liger_fsdp.engage import causal_lm_of, disengage, engage
from llamafactory_liger_fsdp.testing import make_batch, make_model, make_peft, rel

ORIGINALS = ["lm_head.original_module", "model.embed_tokens.original_module"]


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _models():
    ref = make_peft(make_model("llama"), "mts")
    return ref, copy.deepcopy(ref)


def test_engage_marks_the_frozen_originals_and_disengage_unmarks_them():
    _, model = _models()
    causal_lm = causal_lm_of(model)
    assert sorted(wrapping.idle_originals(causal_lm)) == sorted(ORIGINALS)
    engage(model, LigerFsdpConfig(enabled=True, backend="torch"))
    assert all(wrapping.is_marked(causal_lm.get_submodule(p)) for p in ORIGINALS)
    disengage(model)
    assert not any(wrapping.is_marked(causal_lm.get_submodule(p)) for p in ORIGINALS)


def test_a_disabled_or_frozen_copy_leaves_its_original_alone():
    _, model = _models()
    causal_lm = causal_lm_of(model)
    for p in causal_lm.lm_head.modules_to_save.parameters():
        p.requires_grad_(False)
    assert wrapping.idle_originals(causal_lm) == ["model.embed_tokens.original_module"]
    with model.disable_adapter():
        assert wrapping.idle_originals(causal_lm) == []


def test_fsdp2_never_gathers_them_in_a_training_step(group):
    ref, model = _models()
    engage(model, LigerFsdpConfig(enabled=True, backend="torch"))
    causal_lm = causal_lm_of(model)
    wrapping.shard_marked_units(model, below_only=True)
    for layer in causal_lm.model.layers:
        fully_shard(layer)
    fully_shard(model)
    originals = [causal_lm.get_submodule(p) for p in ORIGINALS]
    assert all(isinstance(m, FSDPModule) for m in originals)
    seen = []  # are the originals' weights still shards while the trained head runs, forward and backward?
    head = causal_lm.lm_head.modules_to_save["default"]
    head.register_forward_hook(lambda *_: seen.append([isinstance(m.weight, DTensor) for m in originals]))
    head.register_full_backward_pre_hook(lambda *_: seen.append([isinstance(m.weight, DTensor) for m in originals]))
    batch = make_batch()
    loss = model(**batch).loss
    loss.backward()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    assert len(seen) >= 2 and all(s == [True, True] for s in seen), seen  # the guard's forwards included
    assert rel(loss.detach(), ref_loss.detach()) < 1e-5
    head_grad = head.weight.grad.full_tensor()
    assert rel(head_grad, causal_lm_of(ref).lm_head.modules_to_save["default"].weight.grad) < 1e-5
    # a reference pass (PEFT's disable_adapter, as LLaMA-Factory's DPO runs it) reads the originals through their units
    with torch.no_grad(), model.disable_adapter(), ref.disable_adapter():
        assert rel(model(**batch).loss, ref(**batch).loss) < 1e-5
