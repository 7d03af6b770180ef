"""Frozen weights under FSDP2, one gloo rank in this process.

* The frozen originals of PEFT's ``modules_to_save`` wrappers (``additional_target: embed_tokens,lm_head``) become
  units of their own when the plugin engages (``wrapping.idle_originals``): a training step never gathers them (in the
  root unit they were gathered for every forward and backward), the loss and gradients stay the unsharded model's,
  and a reference pass under ``disable_adapter()`` (DPO) still reads them.
* accelerate's FSDP2 upcast to fp32 leaves frozen shards in the dtype they were loaded in
  (``integration.accelerate.upcast_skips_frozen``; ``keep_frozen_dtype`` casts back any still upcast), bitwise the same
  step."""

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


@pytest.mark.parametrize("how", ["cast_back", "skip"])
def test_frozen_weights_keep_their_dtype_through_accelerates_upcast(group, how):
    """accelerate (<= 1.11) FSDP2's ``model.to(float32)`` under mixed precision, then ``keep_frozen_dtype`` casting the
    frozen shards back (``cast_back``) or, inside ``upcast_skips_frozen``, never cast at all (``skip``: the same
    storage throughout): frozen shards in bf16 (half the bytes), trainable ones fp32, and forward and backward bitwise
    those of the all-fp32 shards (FSDP2 computes in its bf16 param_dtype either way)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from llamafactory_liger_fsdp.integration.accelerate import frozen_dtypes, keep_frozen_dtype, upcast_skips_frozen

    base = make_peft(make_model("llama", dtype=torch.bfloat16), "mts")
    runs = []
    for keep in (False, True):
        model = copy.deepcopy(base)
        before = frozen_dtypes(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in causal_lm_of(model).model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        storage = {name: p.to_local().data_ptr() for name, p in model.named_parameters() if not p.requires_grad}
        if keep and how == "skip":
            with upcast_skips_frozen(model, before) as skipped:
                model.to(torch.float32)  # what accelerate's fsdp2_prepare_model does under mixed precision
                model.to(torch.device("cpu"))  # any other call is nn.Module's
            assert "to" not in model.__dict__ and len(skipped) == len(storage)
            assert storage == {name: p.to_local().data_ptr() for name, p in model.named_parameters()
                               if not p.requires_grad}, "a frozen shard was copied"
        else:
            model.to(torch.float32)
        n, saved = keep_frozen_dtype(model, before) if keep else (0, 0)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        trained = [p for p in model.parameters() if p.requires_grad]
        assert {p.dtype for p in trained} == {torch.float32}
        assert {p.dtype for p in frozen} == ({torch.bfloat16} if keep else {torch.float32})
        if keep and how == "cast_back":
            assert n == len(frozen) and saved == sum(p.to_local().numel() * 2 for p in frozen)
        elif keep:
            assert (n, saved) == (0, 0)  # nothing left to cast back
        loss = model(**make_batch()).loss
        loss.backward()
        runs.append((loss.detach(), {name: p.grad.full_tensor() for name, p in model.named_parameters()
                                     if p.requires_grad}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys() and all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.mark.parametrize("patched,efficient", [(True, False), (False, False), (True, True)])
def test_set_up_holds_no_second_copy_of_the_model(group, monkeypatch, patched, efficient):
    """accelerate's ``fsdp2_prepare_model`` takes ``original_sd = model.state_dict()`` before sharding and reads it only
    under ``cpu_ram_efficient_loading``. Patched (``patch_setup_memory``) and with that option off, every original
    weight is freed once sharded, before the call returns; unpatched (the control) or with the option on (it is read),
    all stay alive until then, and the read state dict is the real one."""
    import gc
    from types import SimpleNamespace

    import accelerate.accelerator as acc

    from llamafactory_liger_fsdp.integration.accelerate import patch_setup_memory

    model = make_peft(make_model("llama", dtype=torch.bfloat16), "mts")
    weak = [p.untyped_storage()._weak_ref() for p in model.parameters()]
    names = list(model.state_dict())
    seen = {}

    def prepare(accelerator, model):  # accelerate's order: the state dict, the units, then (if efficient) its read
        original_sd = model.state_dict()
        for layer in causal_lm_of(model).model.layers:
            fully_shard(layer)
        fully_shard(model)
        gc.collect()
        seen["alive"] = sum(not torch.UntypedStorage._expired(w) for w in weak)
        if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
            seen["read"] = list(original_sd)
        return model

    monkeypatch.setattr(acc, "fsdp2_prepare_model", prepare)
    undo = patch_setup_memory() if patched else []
    try:
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(
            cpu_ram_efficient_loading=efficient)))
        model = acc.fsdp2_prepare_model(accelerator, model)
    finally:
        for u in undo:
            u()
        for w in weak:
            torch.UntypedStorage._free_weak_ref(w)
    assert seen["alive"] == (0 if patched and not efficient else len(weak)), seen
    assert seen.get("read", names) == names
    assert "state_dict" not in model.__dict__ and "to" not in model.__dict__
    assert all(isinstance(p, DTensor) for p in model.parameters())
