"""Model-family quirks of the causal-LM head, as data.

The fused forward in :mod:`.forward` is one function for every family; what differs between
families around the head is listed here and nowhere else:

* ``softcap_attr``: config attribute holding a final-logit softcap (Gemma 2/3:
  ``logits = cap * tanh(logits / cap)``), passed to the kernel as ``softcap``.
* ``moe``: the forward adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits,
  num_experts, num_experts_per_tok, attention_mask)`` to the loss when ``output_router_logits``
  is on (Mixtral, Qwen3-MoE). The function is taken from the model's own modeling module, the
  three numbers from the model instance, exactly as the original forward reads them.

A family not listed here is refused with an error naming the supported ones: its forward may do
something around the head (a logit scale, an extra loss) that we would silently drop.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .config import LigerFsdpConfigError


@dataclass(frozen=True)
class Family:
    model_type: str
    softcap_attr: str | None = None
    moe: bool = False


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2"),
        Family("qwen3"),
        Family("phi3"),
        Family("gemma"),
        Family("gemma2", softcap_attr="final_logit_softcapping"),
        Family("gemma3_text", softcap_attr="final_logit_softcapping"),
        Family("mixtral", moe=True),
        Family("qwen3_moe", moe=True),
    )
}


def family_of(model_type: str | None) -> Family:
    """The family entry for ``config.model_type``; a clear error for anything else."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` does not support model type `{model_type}`. Supported model types: "
            f"{', '.join(sorted(FAMILIES))}. Fix: remove `liger_fsdp` for this model (or file an issue to add it)."
        )
    return family


def softcap(family: Family, config) -> float | None:
    if family.softcap_attr is None:
        return None
    value = getattr(config, family.softcap_attr, None)
    return float(value) if value else None


def moe_aux_loss(family: Family, causal_lm, outputs, attention_mask):
    """The router load-balancing term the original forward adds, or None."""
    if not family.moe or getattr(outputs, "router_logits", None) is None:
        return None
    module = sys.modules[type(causal_lm).__module__]
    return module.load_balancing_loss_func(
        outputs.router_logits, causal_lm.num_experts, causal_lm.num_experts_per_tok, attention_mask
    )


def build_output(family: Family, causal_lm, loss, outputs, attention_mask):
    """The model output the original forward returns, with ``logits=None`` and the family's extra loss terms."""
    if family.moe:
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        aux = moe_aux_loss(family, causal_lm, outputs, attention_mask)
        if aux is not None:
            loss = loss + causal_lm.router_aux_loss_coef * aux.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux, logits=None, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            router_logits=getattr(outputs, "router_logits", None),
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(
        loss=loss, logits=None, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
