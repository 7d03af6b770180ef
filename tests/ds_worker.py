"""2-process DeepSpeed ZeRO parity worker (gloo, CPU), like tests/fsdp_worker.py.

Each rank builds the same tiny model, keeps an unsharded, unfused copy as the reference, engages the plugin
on the other copy and hands it to ``deepspeed.initialize`` (ZeRO stage 0-3, SGD, the default
``stage3_param_persistence_threshold`` unless the case asks for 0, optional CPU offload). The reference replays
both ranks' batches in one process (mean of the per-rank losses, as DeepSpeed averages gradients). Per case:
loss and every trainable gradient after step 1 (``safe_get_full_grad``), every parameter after the last step
(``safe_get_full_fp32_param``), and proof of partitioning (the head weight is an empty placeholder outside the
forward under ZeRO-3, whole under ZeRO-0/1/2).

A case ending in ``:liger`` runs Liger-Kernel's own fused loss instead of the plugin (its class-level forward for
Llama, applied as LLaMA-Factory applies it; fused loss only, under ``TRITON_INTERPRET=1``): what a user without the
plugin gets under ZeRO-3.

A case with ``:bf16`` builds the model in bf16 (PEFT's LoRA weights fp32, as LLaMA-Factory gets them), runs the
plugin's whole load-time engage (its ZeRO-3 dtype policy included) under DeepSpeed's bf16 mode, records the dtypes the
kernel receives, and compares with the unfused reference under the same policy (every parameter bf16).

A case with ``:empty`` passes ``num_items_in_batch`` as the Trainer does (every rank's labels) and gives step 2 no
labelled token on any rank: the model's loss is ``0 / 0`` there and its gradients exactly zero.

Run: python tests/ds_worker.py OUT.json CASE [CASE ...]   (CASE: family:head:stage[:offload][:liger|:bf16|:empty], e.g. llama:mts:3:param)
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.dist import reference_step, spawn  # noqa: E402

STEPS = 3
LR = 0.05
MICRO = 2


def _config(stage: int, offload: str) -> dict:
    zero: dict = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # the tiny head must be partitioned, as a real one is
        # release every parameter as soon as its module is done (no reuse, no prefetch), so that a head kept
        # gathered longer than the loss (e.g. registered as an external parameter of the causal LM) shows
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    if offload in ("param", "both"):
        zero["offload_param"] = {"device": "cpu"}
    if offload in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "train_batch_size": MICRO * 2,
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "gradient_clipping": 0.0,
        "zero_optimization": zero, "steps_per_print": 10**9,
    }


def _proof(causal_lm, done) -> dict:
    from llamafactory_liger_fsdp import gather

    weights = {p: gather.module_at(causal_lm, p).weight for p in done.head.weight_paths}
    return {
        "head_numel_outside_forward": {p: int(w.numel()) for p, w in weights.items()},
        "head_full_numel": {p: int(getattr(w, "ds_numel", w.numel())) for p, w in weights.items()},
        "ds_status": {p: str(getattr(w, "ds_status", "n/a")).split(".")[-1] for p, w in weights.items()},
        "units": len({id(u) for p in done.head.weight_paths for u in gather.units(causal_lm, p)}),
    }


def _watch_head(causal_lm, done, seen: dict) -> None:
    """Record the head weights' ZeRO status while the embedding runs (forward) and when backward reaches the
    embedding's output (late in backward): outside the loss they must be released (NOT_AVAILABLE)."""
    from llamafactory_liger_fsdp import gather

    heads = [gather.param(causal_lm.get_submodule(p)) for p in done.head.weight_paths]

    def status():
        return sorted({str(getattr(w, "ds_status", "n/a")).split(".")[-1] for w in heads})

    def forward_hook(module, args, output):
        seen["embed_forward"].append(status())
        if output.requires_grad:
            output.register_hook(lambda grad: seen["embed_backward"].append(status()))

    causal_lm.get_input_embeddings().register_forward_hook(forward_hook)


_ORIGINAL: dict = {}


def _liger(ref, cand):
    """Liger's fused loss as LLaMA-Factory installs it (class forward; fused loss only: its other Triton kernels do
    not run on the CPU); the reference keeps the original forward. Returns what the result needs of the head."""
    import types
    from types import SimpleNamespace

    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from llamafactory_liger_fsdp import heads
    from llamafactory_liger_fsdp.engage import causal_lm_of

    original = _ORIGINAL.setdefault("forward", LlamaForCausalLM.forward)  # before the first case patched the class
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True)
    reference = causal_lm_of(ref)
    reference.forward = types.MethodType(original, reference)
    done = SimpleNamespace(head=heads.detect(causal_lm_of(cand)), seam=None, config=None)
    return done, lambda causal_lm, seam, config: "Liger's own fused loss"


def _engage_bf16(cand, stage: int, seen: list):
    """The plugin's load-time engage (``integration.llamafactory.engage_model``) for a bf16 model under DeepSpeed
    ZeRO-``stage``; records the dtypes every kernel call receives."""
    from types import SimpleNamespace

    from llamafactory_liger_fsdp import ops
    from llamafactory_liger_fsdp.config import LigerFsdpConfig
    from llamafactory_liger_fsdp.integration.llamafactory import engage_model
    from llamafactory_liger_fsdp.sharding import DEEPSPEED, Sharding

    kernel = ops.fused_linear_cross_entropy

    def spy(hidden, weight, labels, **kw):
        seen.append(f"{hidden.dtype}/{weight.dtype}".replace("torch.", ""))
        return kernel(hidden, weight, labels, **kw)

    ops.fused_linear_cross_entropy = spy
    cfg = LigerFsdpConfig(enabled=True, backend="torch", sharding=Sharding(DEEPSPEED, stage))
    return engage_model(cand, cfg, SimpleNamespace(stage="sft", finetuning_type="lora"))


def run_case(case: str, rank: int, world: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from llamafactory_liger_fsdp.engage import causal_lm_of, engage
    from llamafactory_liger_fsdp.announce import engaged_line
    from llamafactory_liger_fsdp.testing import make_batch, make_model, make_peft, rel

    family, kind, stage, *rest = case.split(":")
    liger, bf16, empty = "liger" in rest, "bf16" in rest, "empty" in rest
    rest = [r for r in rest if r not in ("liger", "bf16", "empty")]
    stage, offload = int(stage), (rest[0] if rest else "none")
    ref = make_peft(make_model(family, seed=0, dtype=torch.bfloat16 if bf16 else torch.float32), kind)
    cand = copy.deepcopy(ref)
    ref.train(), cand.train()
    kernel_dtypes: list = []
    describe = engaged_line
    if liger:
        done, describe = _liger(ref, cand)
    elif bf16:  # as LLaMA-Factory's loader hands it over: the plugin's whole engage, its ZeRO-3 dtype policy included
        done = _engage_bf16(cand, stage, kernel_dtypes)
        ref.to(torch.bfloat16)  # the same policy for the unfused reference (what DeepSpeed does under ZeRO-0/1/2)
    else:
        done = engage(cand, backend="torch")
    assert done is not None, "plugin did not engage"
    trainable = [(n, p) for n, p in cand.named_parameters() if p.requires_grad]
    seen: dict = {"embed_forward": [], "embed_backward": []}
    if not done.head.tied:
        _watch_head(causal_lm_of(cand), done, seen)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    config = dict(_config(stage, offload), **({"bf16": {"enabled": True}} if bf16 else {}))
    engine, *_ = deepspeed.initialize(model=cand, optimizer=torch.optim.SGD([p for _, p in trainable], lr=LR),
                                      config=config, model_parameters=[p for _, p in trainable])
    causal_lm = causal_lm_of(cand)
    result = {"case": case, "kind": done.head.kind, "proof": _proof(causal_lm, done)}
    for step in range(STEPS):
        batches = [make_batch(batch=MICRO, seed=100 * step + r) for r in range(world)]
        if empty:  # as the Trainer calls it: sum / the labels of every rank (step 2: none at all, 0 / 0)
            if step == 1:
                for batch in batches:
                    batch["labels"][:] = -100
            items = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
            for batch in batches:
                batch["num_items_in_batch"] = items
        ref_losses = reference_step(ref, batches)
        loss = engine(**batches[rank]).loss
        engine.backward(loss)
        if empty and step == 1:  # what DeepSpeed would otherwise hide: its optimizer skips a step with NaN gradients
            grads = [safe_get_full_grad(p) for _, p in trainable]
            result["empty_step_grads"] = {"finite": all(bool(torch.isfinite(g).all()) for g in grads if g is not None),
                                          "zero": all(not g.any() for g in grads if g is not None)}
        if step == 0:
            result["engaged"] = describe(causal_lm, done.seam, done.config)
            result["loss_rel"] = abs(float(loss) - ref_losses[rank]) / abs(ref_losses[rank])
            ref_named = dict(ref.named_parameters())
            grads = {n: safe_get_full_grad(p) for n, p in trainable}
            result["grad_rels"] = {n: rel(g, ref_named[n].grad) if g is not None and ref_named[n].grad is not None
                                   else (0.0 if g is None and ref_named[n].grad is None else float("inf"))
                                   for n, g in grads.items()}
        engine.step()
        opt_ref.step()
        opt_ref.zero_grad()
    ref_named = dict(ref.named_parameters())
    after = {}
    for n, p in trainable:
        full = safe_get_full_fp32_param(p)
        after[n] = (p if full is None else full).detach().clone()
    result["head_while_embedding"] = seen
    result["kernel_dtypes"] = sorted(set(kernel_dtypes))
    result["param_rels_after"] = max(rel(after[n], ref_named[n]) for n, _ in trainable)
    init = dict(make_peft(make_model(family, seed=0, dtype=torch.bfloat16 if bf16 else torch.float32),
                          kind).named_parameters())
    result["moved"] = rel(torch.cat([after[n].flatten() for n, _ in trainable]),
                          torch.cat([init[n].detach().flatten() for n, _ in trainable]))
    engine.destroy()
    return result


def _rank(rank: int, world: int, cases: list[str]) -> list[dict]:
    if any(case.endswith(":liger") for case in cases):
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: Liger's kernel on CPU tensors
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # from the environment spawn gives every rank
    from llamafactory_liger_fsdp import ops

    kernel, results = ops.fused_linear_cross_entropy, []
    for case in cases:
        try:
            results.append(run_case(case, rank, world))
        except Exception:
            results.append({"case": case, "error": traceback.format_exc()})
        finally:
            ops.fused_linear_cross_entropy = kernel  # a bf16 case's spy (_engage_bf16) ends with its case
    return results


if __name__ == "__main__":
    spawn(_rank, (sys.argv[2:],), out=sys.argv[1], init=False, env={"CUDA_VISIBLE_DEVICES": ""})
