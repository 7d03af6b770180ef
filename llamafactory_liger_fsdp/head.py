"""The generic causal-LM loss: hidden states -> fused loss through the head module, all families.

:func:`engage` is the whole public surface: given a (PEFT) causal LM it finds the head and how it
is trained (:func:`inspect_head`), tags the modules that must be their own FSDP unit
(:mod:`.wrapping`), and replaces the causal LM's ``forward`` *on that instance* by one generic
forward. In training, with labels, that forward

1. runs the decoder exactly as the original forward does (same arguments, ``**kwargs`` included),
2. computes the loss in :func:`head_loss` -- **the one place where the loss is computed** -- with
   :func:`llamafactory_liger_fsdp.ops.fused_linear_cross_entropy`, called through the FSDP units
   that own the head's weights (:func:`wrapping.call_through`), so they are gathered exactly
   while the kernel runs, and
3. adds the family's extra terms (MoE router aux loss; :mod:`.families`).

The label shift, ``ignore_index`` and ``num_items_in_batch`` normalisation are transformers'
``ForCausalLMLoss``: ``sum / num_items_in_batch`` when it is given, else the mean. In eval, or
without labels, the original forward runs untouched (callers may want the logits).

Head kinds (``HeadPlan.kind``):

* ``modules_to_save`` -- PEFT ``ModulesToSaveWrapper`` (``additional_target: lm_head``): the
  kernel reads the active trained copy's weight.
* ``lora`` -- PEFT LoRA on the head (``lm_head`` in ``lora_target``): the LoRA delta enters the
  loss exactly: ``h W^T + s * (A drop(h))^T B^T = [h, s*A drop(h)] [W, B]^T``, one kernel call
  on the concatenation, so lora_A/lora_B get their gradients (A through its own module call).
* ``full`` -- a plain trainable ``nn.Linear`` (full fine-tuning).

A frozen head needs nothing from us: :func:`engage` says so and leaves the model alone. A head
weight shared with another module (tied embeddings) is never split into its own unit: it stays
in the unit that owns it (the root), whose forward is running when the loss is computed.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from . import families, ops, wrapping
from .config import LigerFsdpConfigError
from .families import Family

logger = logging.getLogger("llamafactory_liger_fsdp")

PLAN_ATTR = "_liger_fsdp_plan"


@dataclass
class HeadPlan:
    """What the fused forward needs to know about one model's head."""

    kind: str  # "modules_to_save" | "lora" | "full"
    family: Family
    head_path: str  # the head module, relative to the causal LM ("lm_head")
    weight_paths: tuple[str, ...]  # modules whose ``.weight`` the kernel reads (LoRA: base, then lora_B)
    tied: bool = False
    softcap: float | None = None
    backend: str | None = None
    lora_a_path: str | None = None
    lora_dropout_path: str | None = None
    lora_scaling: float = 1.0
    marked: tuple[str, ...] = ()
    announced: bool = field(default=False, repr=False)

    def describe(self) -> str:
        return f"head={self.kind}{' (tied)' if self.tied else ''} ({self.head_path})"


# --------------------------------------------------------------------------- inspection
def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside a PEFT model (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _classnames(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _path_of(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    raise LigerFsdpConfigError("liger_fsdp: the output embedding is not a submodule of the model")  # pragma: no cover


def _is_shared(root: nn.Module, param: torch.Tensor) -> bool:
    return sum(1 for _, p in root.named_parameters(remove_duplicate=False) if p is param) > 1


def _only_adapter(layer: nn.Module, what: str) -> str:
    active = list(getattr(layer, "active_adapters", []) or [])
    if len(active) != 1:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` needs exactly one active adapter on the {what} head, found {active}. "
            "Fix: train one adapter at a time, or remove `liger_fsdp`."
        )
    return active[0]


def inspect_head(causal_lm: nn.Module, family: Family, backend: str | None = None) -> HeadPlan | str:
    """A :class:`HeadPlan`, or a string saying why nothing needs doing (frozen head).

    Raises :class:`LigerFsdpConfigError` for heads the fused loss cannot reproduce exactly.
    """
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: {type(causal_lm).__name__} has no output embedding (lm_head). Fix: remove `liger_fsdp`."
        )
    head_path = _path_of(causal_lm, head)
    names = _classnames(head)
    softcap = families.softcap(family, causal_lm.config)
    common = dict(family=family, head_path=head_path, softcap=softcap, backend=backend)

    if "ModulesToSaveWrapper" in names:
        if head.disable_adapters:
            return "the lm_head copy in `additional_target` is disabled (adapters off): the head is frozen"
        adapter = _only_adapter(head, "modules_to_save")
        inner = head.modules_to_save[adapter]
        _check_linear(inner, "the trained lm_head copy (modules_to_save)")
        if not inner.weight.requires_grad:
            return "the lm_head copy in `additional_target` is frozen"
        path = f"{head_path}.modules_to_save.{adapter}"
        return HeadPlan(kind="modules_to_save", weight_paths=(path,), tied=_is_shared(causal_lm, inner.weight), **common)

    if "LoraLayer" in names:
        if head.disable_adapters or head.merged:
            return "LoRA on lm_head is disabled or merged: the head is frozen"
        adapter = _only_adapter(head, "LoRA")
        if adapter not in head.lora_A:
            return "the active adapter has no LoRA on lm_head: the head is frozen"
        problems = []
        if head.use_dora.get(adapter, False) or adapter in getattr(head, "lora_variant", {}):
            problems.append("DoRA/LoRA variants")
        if getattr(head, "fan_in_fan_out", False):
            problems.append("fan_in_fan_out")
        if getattr(head.lora_B[adapter], "bias", None) is not None:
            problems.append("lora_bias")
        if problems:
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` supports plain LoRA on lm_head; this head uses {', '.join(problems)}. "
                "Fix: use plain LoRA on lm_head (or put lm_head in `additional_target`), or remove `liger_fsdp`."
            )
        base = head.base_layer
        _check_linear(base, "the LoRA head's base layer")
        _check_linear(head.lora_B[adapter], "the LoRA head's lora_B")
        if not (head.lora_A[adapter].weight.requires_grad or head.lora_B[adapter].weight.requires_grad):
            return "the LoRA weights on lm_head are frozen"
        return HeadPlan(
            kind="lora",
            weight_paths=(f"{head_path}.base_layer", f"{head_path}.lora_B.{adapter}"),
            tied=_is_shared(causal_lm, base.weight),
            lora_a_path=f"{head_path}.lora_A.{adapter}",
            lora_dropout_path=f"{head_path}.lora_dropout.{adapter}",
            lora_scaling=float(head.scaling[adapter]),
            **common,
        )

    if type(head) is nn.Linear:
        _check_linear(head, "lm_head")
        if not head.weight.requires_grad:
            return "lm_head is frozen (not in `additional_target` or `lora_target`, no full fine-tuning)"
        return HeadPlan(kind="full", weight_paths=(head_path,), tied=_is_shared(causal_lm, head.weight), **common)

    raise LigerFsdpConfigError(
        f"`liger_fsdp: true` does not know the head module {type(head).__name__} (quantized or from another tuner). "
        "Supported: nn.Linear (full fine-tuning), PEFT modules_to_save (`additional_target: lm_head`), plain LoRA. "
        "Fix: remove `liger_fsdp` for this run."
    )


def _check_linear(module: nn.Module, what: str) -> None:
    if not isinstance(module, nn.Linear) or not module.weight.is_floating_point():
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: {what} is {type(module).__name__}, not a floating-point nn.Linear "
            "(quantized heads are not supported). Fix: do not quantize the head, or remove `liger_fsdp`."
        )
    if module.bias is not None:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: {what} has a bias, which the fused loss does not add. Fix: remove `liger_fsdp`."
        )


# --------------------------------------------------------------------------- the loss
def head_loss(
    causal_lm: nn.Module,
    plan: HeadPlan,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    probe: "_MemoryProbe | None" = None,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``lm_head(hidden)``, computed by the fused kernel."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    kernel = functools.partial(
        ops.fused_linear_cross_entropy,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=plan.softcap,
        backend=resolve_backend(plan.backend, h.device),
    )
    if probe is not None:
        kernel = functools.partial(probe.run, kernel)
    resolved = [wrapping.resolve(causal_lm, p) for p in plan.weight_paths]
    units = [u for unit_list, _ in resolved for u in unit_list]
    modules = [m for _, m in resolved]

    if plan.kind == "lora":
        _, lora_a = wrapping.resolve(causal_lm, plan.lora_a_path)
        dropout = wrapping.entry_at(causal_lm, plan.lora_dropout_path)
        a_dtype = wrapping.param_dtype(lora_a)  # PEFT casts the LoRA input to lora_A's dtype
        x = h if a_dtype is None else h.to(a_dtype)
        # lora_A is called as a module: through its own FSDP unit, if it is one
        u = wrapping.entry_at(causal_lm, plan.lora_a_path)(dropout(x)) * plan.lora_scaling

        def fn(h_in: torch.Tensor, u_in: torch.Tensor, y_in: torch.Tensor) -> torch.Tensor:
            base_w, b_w = modules[0].weight, modules[1].weight
            _check_gathered(base_w, b_w)
            dtype = torch.promote_types(torch.promote_types(h_in.dtype, u_in.dtype), torch.promote_types(base_w.dtype, b_w.dtype))
            hcat = torch.cat([h_in.to(dtype), u_in.to(dtype)], dim=-1)
            wcat = torch.cat([base_w.to(dtype), b_w.to(dtype)], dim=-1)
            return kernel(hcat, wcat, y_in)

        loss = wrapping.call_through(units, fn, h, u, y)
    else:

        def fn(h_in: torch.Tensor, y_in: torch.Tensor) -> torch.Tensor:
            w = modules[0].weight
            _check_gathered(w)
            return kernel(h_in, w, y_in)

        loss = wrapping.call_through(units, fn, h, y)

    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The plugin's ``auto``: ``triton_fast`` on CUDA (it measured faster than the unfused loss in
    real SFT, bench/RESULTS.md), ``torch`` elsewhere."""
    if backend in (None, "auto"):
        return ops.default_backend(device, fast=True)
    return backend


def _check_gathered(*weights: torch.Tensor) -> None:
    for w in weights:
        if wrapping.is_sharded_weight(w):
            raise RuntimeError(
                f"liger_fsdp: the head weight is still sharded ({type(w).__name__} {tuple(w.shape)}) inside the "
                "call-through; the FSDP unit that owns it was not found on the path. Please report this with your "
                "FSDP settings."
            )


# --------------------------------------------------------------------------- the forward
def _fused_forward(causal_lm: nn.Module, plan: HeadPlan, original, signature: inspect.Signature, *args, **kwargs):
    bound = signature.bind_partial(*args, **kwargs)
    params = dict(bound.arguments)
    var_kw = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = dict(params.pop(var_kw, {}) if var_kw else {})
    labels = params.get("labels")
    if not (causal_lm.training and labels is not None):
        return original(*args, **kwargs)
    params.pop("labels")
    logits_to_keep = params.pop("logits_to_keep", 0)
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("liger_fsdp: `logits_to_keep` must be 0 when training with labels")
    if plan.family.moe:
        orl = params.get("output_router_logits")
        params["output_router_logits"] = causal_lm.config.output_router_logits if orl is None else orl

    first_step = not plan.announced
    if first_step:
        plan.announced = True
        _announce(causal_lm, plan)

    decoder = getattr(causal_lm, causal_lm.base_model_prefix)
    outputs = decoder(**params, **extra)
    hidden = outputs.last_hidden_state
    probe = None
    if first_step and hidden.is_cuda and _rank0():
        probe = _MemoryProbe(causal_lm.get_output_embeddings().out_features)
    loss = head_loss(
        causal_lm,
        plan,
        hidden,
        labels,
        shift_labels=extra.get("shift_labels"),
        num_items_in_batch=extra.get("num_items_in_batch"),
        ignore_index=extra.get("ignore_index", -100),
        probe=probe,
    )
    aux = families.moe_aux_loss(plan.family, causal_lm, outputs, params.get("attention_mask"))
    if plan.family.moe:
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        if aux is not None:
            loss = loss + causal_lm.router_aux_loss_coef * aux.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=getattr(outputs, "router_logits", None),
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


class _MemoryProbe:
    """Measures once (first training step, CUDA, rank 0) the peak memory the fused kernel needs
    beyond its inputs and the gradients it returns, in forward and in backward, and logs it beside
    what the unfused logits of the same step would need (computed: bf16 logits + fp32 copy + fp32
    log-softmax, at least 10 bytes a logit). The window is the kernel alone (inside the FSDP
    call-through), so FSDP's own gathers and reduce-scatters are not counted. Resets CUDA's
    peak-memory statistics twice, on that step only."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.peaks: dict[str, float] = {}

    def run(self, kernel, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dev = h.device
        self.tokens = h.shape[0]
        self.grad_bytes = (h.numel() * h.element_size() if h.requires_grad else 0) + (
            w.numel() * w.element_size() if w.requires_grad else 0
        )
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        loss = kernel(h, w, y)
        self.peaks["forward"] = torch.cuda.max_memory_allocated(dev) - base
        if loss.requires_grad and h.requires_grad:
            state = {}

            def before(grad):
                torch.cuda.reset_peak_memory_stats(dev)
                state["base"] = torch.cuda.memory_allocated(dev)

            def after(grad):
                self.peaks["backward"] = max(
                    torch.cuda.max_memory_allocated(dev) - state["base"] - self.grad_bytes, 0
                )
                self.log()

            loss.register_hook(before)
            h.register_hook(after)
        else:
            self.log()
        return loss

    def log(self) -> None:
        from ._log import info_rank0

        gib = 2**30
        parts = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in self.peaks.items())
        info_rank0(
            f"[liger_fsdp] memory (step 1, measured): the fused loss kernel needed {max(self.peaks.values()) / gib:.2f} GiB "
            f"beyond its inputs and gradients ({parts}); unfused logits for these {self.tokens} tokens would need at least "
            f"{self.tokens * self.vocab * 10 / gib:.1f} GiB (vocab {self.vocab}, 10 bytes a logit)."
        )


def _rank0() -> bool:
    from ._log import rank

    return rank() == 0


def _announce(causal_lm: nn.Module, plan: HeadPlan) -> None:
    from ._log import info_rank0

    units = list({id(u): u for p in plan.weight_paths for u in wrapping.resolve(causal_lm, p)[0]}.values())
    fsdp = wrapping.fsdp_version(causal_lm)
    backend = resolve_backend(plan.backend, causal_lm.get_output_embeddings().weight.device)
    if units:
        names = wrapping.unit_names(causal_lm, units)
        where = f"through {len(units)} FSDP unit(s) ({', '.join(names)})"
    else:
        where = "inside the root unit" if fsdp != "none" else "unsharded"
    info_rank0(
        f"[liger_fsdp] engaged: {plan.describe()}, fsdp={fsdp}, backend={backend}, model={plan.family.model_type}; "
        f"loss computed {where}"
    )


def engage(model: nn.Module, backend: str | None = None) -> HeadPlan | None:
    """Make ``model`` (PEFT or plain causal LM) compute its training loss with the fused kernel.

    Returns the plan, or None when nothing needed doing (frozen head; the reason is logged).
    Must be called before FSDP wraps the model (the tags decide the wrapping).
    """
    from ._log import info_rank0

    causal_lm = causal_lm_of(model)
    if PLAN_ATTR in causal_lm.__dict__:
        return causal_lm.__dict__[PLAN_ATTR]
    family = families.family_of(getattr(causal_lm.config, "model_type", None))
    loss_fn = getattr(causal_lm, "loss_function", None)
    if loss_fn is not None and getattr(loss_fn, "__name__", "ForCausalLMLoss") != "ForCausalLMLoss":
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: the model's loss_function is {getattr(loss_fn, '__name__', loss_fn)}, not "
            "transformers' ForCausalLMLoss, so the fused loss would not reproduce it. Fix: remove `liger_fsdp`."
        )
    plan = inspect_head(causal_lm, family, backend)
    if isinstance(plan, str):
        info_rank0(f"[liger_fsdp] not engaged: {plan}; the plain loss has nothing to fix.")
        return None
    marked = []
    for path in plan.weight_paths:
        module = causal_lm.get_submodule(path)
        if not _is_shared(causal_lm, module.weight):
            wrapping.mark_unit(module)
            marked.append(path)
    plan.marked = tuple(marked)
    original = causal_lm.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return _fused_forward(causal_lm, plan, original, signature, *args, **kwargs)

    causal_lm.__dict__["forward"] = forward
    causal_lm.__dict__[PLAN_ATTR] = plan
    return plan


def disengage(model: nn.Module) -> None:
    """Undo :func:`engage` (before FSDP wrapping; afterwards the units stay as they were built)."""
    causal_lm = causal_lm_of(model)
    plan = causal_lm.__dict__.pop(PLAN_ATTR, None)
    causal_lm.__dict__.pop("forward", None)
    if plan is not None:
        for path in plan.marked:
            wrapping.unmark_unit(causal_lm.get_submodule(path))


def plan_of(model: nn.Module) -> HeadPlan | None:
    return causal_lm_of(model).__dict__.get(PLAN_ATTR)
