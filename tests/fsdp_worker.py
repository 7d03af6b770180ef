"""2-process FSDP parity worker (gloo, CPU), in the style of PyTorch's own FSDP tests.

Each rank builds the same tiny model, keeps an unsharded, unfused copy as the reference, engages
the plugin on the other copy, shards it (FSDP1 with PEFT's wrap policy composed with ours, or
FSDP2 ``fully_shard`` children-first) and runs a few SGD steps on its own batch. The reference
replays both ranks' batches in one process (mean of the per-rank losses, as FSDP averages the
gradients). Per case the worker records the loss and every trainable gradient's rel diff after
step 1, the rel diff of every parameter after the last step, and proof that sharding happened.

Run: python tests/fsdp_worker.py MODE OUT.json CASE [CASE ...]   (MODE: fsdp1_orig, fsdp1_flat, fsdp2, ddp)
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.dist import reference_step, spawn  # noqa: E402

STEPS = 3
LR = 0.05


def _canon(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(junk, "")
    return name


def _flat_full_grads(model) -> dict[str, torch.Tensor]:
    """FSDP1 use_orig_params=False: all-gather each FlatParameter's grad shard and split it by fqn."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = {}
    prefix_of = {m: _canon(n) for n, m in model.named_modules() if isinstance(m, FSDP)}
    for unit, prefix in prefix_of.items():
        fp = getattr(unit, "_flat_param", None)
        if fp is None or fp.grad is None:
            continue
        shards = [torch.empty_like(fp.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, fp.grad.contiguous())
        full = torch.cat(shards)
        offset = 0
        for fqn, shape, numel in zip(fp._fqns, fp._shapes, fp._numels):
            key = (prefix + "." if prefix else "") + fqn
            out[_canon(key)] = full[offset : offset + numel].view(shape).clone()
            offset += numel
    return out


def _full_state(model, mode) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Full (unsharded) parameters and grads of the sharded model, keyed by canonical name."""
    params, grads = {}, {}
    if mode == "ddp":
        for n, p in model.module.named_parameters():
            params[n] = p.detach().clone()
            if p.grad is not None:
                grads[n] = p.grad.clone()
        return params, grads
    if mode == "fsdp2":
        for n, p in model.named_parameters():
            params[_canon(n)] = p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            if p.grad is not None:
                g = p.grad
                grads[_canon(n)] = g.full_tensor().clone() if hasattr(g, "full_tensor") else g.clone()
        return params, grads
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with_grads = mode == "fsdp1_orig"
    with FSDP.summon_full_params(model, with_grads=with_grads):
        for n, p in model.named_parameters():
            params[_canon(n)] = p.detach().clone()
            if with_grads and p.grad is not None:
                grads[_canon(n)] = p.grad.clone()
    if not with_grads:
        grads = _flat_full_grads(model)
    return params, grads


def _shard(model, mode):
    from llamafactory_liger_fsdp import wrapping

    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)

    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        layer_cls = type(model.get_decoder().layers[0]) if hasattr(model, "get_decoder") else None
        wrapping.shard_marked_units(model, mesh=mesh)
        for m in list(model.modules()):
            if layer_cls is not None and isinstance(m, layer_cls):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from peft import PeftModel
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    import functools

    if isinstance(model, PeftModel):
        base = fsdp_auto_wrap_policy(model)  # what transformers' Trainer uses with PEFT
    else:
        layer_cls = type(model.get_decoder().layers[0])
        base = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    return FSDP(
        model,
        auto_wrap_policy=wrapping.fsdp1_policy(base),
        use_orig_params=(mode == "fsdp1_orig"),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
    )


def _sharding_proof(model, plan, mode) -> dict:
    """Evidence that the head's trained weight really is sharded across the 2 ranks."""
    from llamafactory_liger_fsdp import gather, sharding
    from llamafactory_liger_fsdp.engage import causal_lm_of

    causal_lm = causal_lm_of(model.module if hasattr(model, "module") else model)
    units, module = gather.resolve(causal_lm, plan.head.weight_paths[-1])
    proof = {"head_units": len(units), "fsdp": sharding.observed(model) or "none"}
    if mode == "ddp":
        proof["ddp"] = type(model).__name__
    elif mode == "fsdp2":
        w = module.weight
        proof["dtensor"] = type(w).__name__ == "DTensor"
        proof["local_rows"] = int(w.to_local().shape[0]) if proof["dtensor"] else -1
        proof["full_rows"] = int(w.shape[0])
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        owner = units[-1] if units else model
        fp = owner._flat_param
        proof["local_numel"] = int(fp.numel())
        proof["full_numel"] = int(sum(fp._numels))
        proof["n_fsdp_modules"] = len(FSDP.fsdp_modules(model))
    return proof


def run_case(case: str, mode: str, rank: int, world: int) -> dict:
    from llamafactory_liger_fsdp.testing import make_inputs, make_model, make_peft, rel

    from llamafactory_liger_fsdp.engage import engage

    family, kind = case.split(":")
    ref = make_peft(make_model(family, seed=0), kind)
    cand = copy.deepcopy(ref)
    ref.train()
    cand.train()
    plan = engage(cand, backend="torch")
    assert plan is not None, "plugin did not engage"
    sharded = _shard(cand, mode)
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.SGD([p for p in sharded.parameters() if p.requires_grad], lr=LR)
    result = {"case": case, "mode": mode, "plan_kind": plan.head.kind, "tied": plan.head.tied}
    for step in range(STEPS):
        batches = [make_inputs(family, seed=100 * step + r) for r in range(world)]  # images for a VLM
        ref_losses = reference_step(ref, batches)
        loss = sharded(**batches[rank]).loss
        loss.backward()
        if step == 0:
            result["loss"] = float(loss)
            result["ref_loss"] = ref_losses[rank]
            result["loss_rel"] = abs(float(loss) - ref_losses[rank]) / abs(ref_losses[rank])
            _, grads = _full_state(sharded, mode)
            ref_named = dict(ref.named_parameters())
            grad_rels = {}
            for n in trainable:
                g_ref = ref_named[n].grad
                g = grads.get(_canon(n))
                grad_rels[n] = rel(g, g_ref) if g is not None else float("inf")
            result["grad_rels"] = grad_rels
            result["proof"] = _sharding_proof(sharded, plan, mode)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    params, _ = _full_state(sharded, mode)
    ref_named = dict(ref.named_parameters())
    result["param_rels_after"] = max(rel(params[_canon(n)], ref_named[n]) for n in trainable)
    init = dict(make_peft(make_model(family, seed=0), kind).named_parameters())
    after = torch.cat([params[_canon(n)].flatten() for n in trainable])
    before = torch.cat([init[n].detach().flatten() for n in trainable])
    result["moved"] = rel(after, before)  # training really changed the weights
    return result


def _rank(rank: int, world: int, mode: str, cases: list[str]) -> list[dict]:
    results = []
    for case in cases:
        try:
            results.append(run_case(case, mode, rank, world))
        except Exception:
            results.append({"case": case, "mode": mode, "error": traceback.format_exc()})
    return results


if __name__ == "__main__":
    spawn(_rank, (sys.argv[1], sys.argv[3:]), out=sys.argv[2])
