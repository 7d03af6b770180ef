"""Model-family quirks around the head, as data: one frozen :class:`Family` per ``config.model_type``.

The fused forward (:mod:`.forward`) is one function for every family; it reads these fields and
nothing else. Each entry was read off the class's own ``forward`` in transformers 5.6 (``cls``: the
class LLaMA-Factory 0.9.5 builds) and is checked against it by a parity test and, at run time, by the
step-1 guard (:mod:`.guard`). Attribute paths: ``config.X``, ``text_config.X`` (``config.get_text_config()``)
or a bare ``X`` (an attribute of the model; of the config where there is no model, e.g. in ``doctor``).

* ``softcap``: final-logit softcap ``cap * tanh(z / cap)``, inside the kernel.
* ``scale`` / ``scale_divides``: logits ``* s`` (Cohere) or ``/ s`` (Granite), applied exactly to the
  kernel's input rows (the bias column included).
* ``loss``: ``causal_lm`` = ``ForCausalLMLoss(**kwargs)`` (``num_items_in_batch``, ``shift_labels``,
  ``ignore_index``); ``mean`` = ``ForCausalLMLoss`` called without kwargs (mean over labels != -100);
  ``masked_mean`` = Gemma 3's own mean that also drops positions whose shifted attention mask is 0.
* ``moe``: the router load-balancing loss the forward adds (:class:`MoeAux`).
* ``decoder``: attribute of the decoder where ``base_model_prefix`` names none (Llama 4 text).
* ``refuse`` / ``refuse_if``: why the family (or the family with a config flag on) is refused.

A head with a bias (phi, phimoe ``lm_head_bias``) needs no entry: the head strategies add it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LigerFsdpConfigError


@dataclass(frozen=True)
class MoeAux:
    gate: str  # "config": the output_router_logits argument, else config.output_router_logits; "kwarg": the kwarg only
    num_experts: str
    top_k: str
    coef: str


@dataclass(frozen=True)
class Family:
    model_type: str
    cls: str
    softcap: str | None = None
    scale: str | None = None
    scale_divides: bool = False
    loss: str = "causal_lm"
    moe: MoeAux | None = None
    decoder: str | None = None
    refuse: str | None = None
    refuse_if: tuple[str, str, str] | None = None  # (attribute path, reason, fix): refused while that value is true


_MOE = MoeAux("config", "num_experts", "num_experts_per_tok", "router_aux_loss_coef")
_VLM_MOE = MoeAux("kwarg", "text_config.num_experts", "text_config.num_experts_per_tok",
                  "text_config.router_aux_loss_coef")
_CAP = "config.final_logit_softcapping"
_GRANITE_AUX = ("config.output_router_logits", "transformers 5.6's Granite MoE models never record router logits, so "
                "their own forward fails with `output_router_logits` on ('int' object has no attribute 'to'); "
                "LLaMA-Factory turns it on with `moe_aux_loss_coef`",
                "remove `moe_aux_loss_coef` (so that the router aux loss stays off), or remove `liger_fsdp`")
_LLAMA4 = ("Llama4ForConditionalGeneration merges the image features itself and calls a whole Llama4ForCausalLM "
           "(`language_model`) for its logits, so there is no decoder call whose hidden states the fused loss could "
           "take (and its `base_model_prefix` 'model' names no module)")

_PLAIN = {  # forward identical to Llama's (CausalLM) or to Llava's (ForConditionalGeneration)
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM", "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM", "olmo": "OlmoForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "ministral": "MinistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM", "phi": "PhiForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration", "internvl": "InternVLForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration", "paligemma": "PaliGemmaForConditionalGeneration",
    "mllama": "MllamaForConditionalGeneration",
}
_MEAN_ONLY = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration", "glm46v": "Glm46VForConditionalGeneration",
}
_MOE_TYPES = {
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
    "olmoe": "OlmoeForCausalLM", "flex_olmo": "FlexOlmoForCausalLM", "phimoe": "PhimoeForCausalLM",
}

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        *(Family(t, c) for t, c in _PLAIN.items()),
        *(Family(t, c, loss="mean") for t, c in _MEAN_ONLY.items()),
        *(Family(t, c, moe=_MOE) for t, c in _MOE_TYPES.items()),
        Family("gemma2", "Gemma2ForCausalLM", softcap=_CAP),
        Family("gemma3_text", "Gemma3ForCausalLM", softcap=_CAP),
        Family("gemma4_text", "Gemma4ForCausalLM", softcap=_CAP),
        Family("gemma4", "Gemma4ForConditionalGeneration", softcap="text_config.final_logit_softcapping"),
        Family("gemma3", "Gemma3ForConditionalGeneration", loss="masked_mean"),  # no softcap in this class
        Family("granite", "GraniteForCausalLM", scale="config.logits_scaling", scale_divides=True),
        *(Family(t, c, scale="config.logits_scaling", scale_divides=True, refuse_if=_GRANITE_AUX) for t, c in (
            ("granitemoe", "GraniteMoeForCausalLM"), ("granitemoeshared", "GraniteMoeSharedForCausalLM"),
            ("granitemoehybrid", "GraniteMoeHybridForCausalLM"))),
        Family("cohere", "CohereForCausalLM", scale="logit_scale"),
        Family("cohere2", "Cohere2ForCausalLM", scale="logit_scale"),
        Family("llama4_text", "Llama4ForCausalLM", decoder="model"),
        Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", loss="mean", moe=_VLM_MOE),
        Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", loss="mean", moe=_VLM_MOE),
        Family("glm4v_moe", "Glm4vMoeForConditionalGeneration", loss="mean",
               moe=MoeAux("kwarg", "num_experts", "num_experts_per_tok", "text_config.router_aux_loss_coef")),
        Family("llama4", "Llama4ForConditionalGeneration", refuse=_LLAMA4),
    )
}

_FIX = "Fix: remove `liger_fsdp` for this model (or file an issue to add it)."


def read(path: str, config, model=None):
    """The value at an attribute path (module docstring), or None."""
    head, _, attr = path.partition(".")
    if head == "text_config":
        return getattr(config.get_text_config(), attr, None)
    if head == "config":
        return getattr(config, attr, None)
    return getattr(model if model is not None else config, path, None)


def model_class(family: Family):
    """The class object transformers exports under the entry's class name (None if this transformers has none)."""
    import transformers

    try:
        return getattr(transformers, family.cls)
    except (AttributeError, ImportError):
        return None


def family_of(model_type: str | None, config=None, cls: type | None = None) -> Family:
    """The entry for ``config.model_type``; a clear error for anything refused or unknown.

    With ``config`` the config-dependent refusals are checked too, with ``cls`` the model class (by identity: a
    remote-code class of the same name is another class)."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        supported = sorted(t for t, f in FAMILIES.items() if f.refuse is None)
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` does not support model type `{model_type}`. Supported model types: "
            f"{', '.join(supported)}. {_FIX}"
        )
    if family.refuse:
        raise LigerFsdpConfigError(f"`liger_fsdp: true` does not support model type `{model_type}`: {family.refuse}. {_FIX}")
    if cls is not None and cls is not model_class(family):
        where = f"{cls.__module__}.{cls.__qualname__}"
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: the quirks of model type `{model_type}` were read from transformers' {family.cls}, but "
            f"this model is {where} (remote code, or another head class), whose loss may differ. {_FIX}"
        )
    if config is not None and family.refuse_if and read(family.refuse_if[0], config):
        path, why, fix = family.refuse_if
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` does not support `{model_type}` with `{path.split('.')[-1]}` on: {why}. Fix: {fix}."
        )
    return family


def softcap(family: Family, config) -> float | None:
    value = read(family.softcap, config) if family.softcap else None
    return float(value) if value else None


def logit_scale(family: Family, config, model=None) -> tuple[float, bool] | None:
    """``(s, divides)``: the logits are ``* s`` (``/ s`` when ``divides``); None when there is no scale."""
    value = read(family.scale, config, model) if family.scale else None
    if value is None or float(value) == 1.0:
        return None
    return (float(value), family.scale_divides)


def aux_on(family: Family, config, params: dict, extra: dict) -> bool:
    """Whether the original forward adds the router aux loss for this call (sets the decoder's flag)."""
    if family.moe is None:
        return False
    if family.moe.gate == "kwarg":
        return bool(extra.get("output_router_logits", False))
    arg = params.get("output_router_logits", extra.pop("output_router_logits", None))
    params["output_router_logits"] = bool(config.output_router_logits if arg is None else arg)
    return params["output_router_logits"]


def aux_term(family: Family, causal_lm, outputs, attention_mask):
    """(aux loss, coefficient), as the original forward computes them."""
    import sys

    moe, cfg = family.moe, causal_lm.config
    aux = sys.modules[model_class(family).__module__].load_balancing_loss_func(
        outputs.router_logits, read(moe.num_experts, cfg, causal_lm), read(moe.top_k, cfg, causal_lm), attention_mask
    )
    return aux, read(moe.coef, cfg, causal_lm)


def describe(family: Family, config, model=None) -> list[str]:
    """The quirks in words (engaged line, doctor)."""
    out = []
    cap = softcap(family, config)
    if cap:
        out.append(f"final-logit softcap {cap:g} ({family.softcap})")
    scale = logit_scale(family, config, model)
    if scale:
        out.append(f"logits {'/' if scale[1] else '*'} {scale[0]:g} ({family.scale})")
    if family.loss != "causal_lm":
        out.append({"mean": "mean loss (the model ignores num_items_in_batch)",
                    "masked_mean": "mean loss over attention_mask != 0 (ignores num_items_in_batch)"}[family.loss])
    if family.moe is not None:
        on = "with the `output_router_logits` kwarg" if family.moe.gate == "kwarg" else (
            "on" if getattr(config, "output_router_logits", False) else "off (output_router_logits false)")
        out.append(f"MoE router aux loss x {read(family.moe.coef, config, model)} ({on})")
    if family.decoder:
        out.append(f"decoder `{family.decoder}`")
    return out


def build_output(family: Family, causal_lm, loss, outputs, attention_mask, with_aux: bool):
    """The model output the original forward returns, with ``logits=None`` and the family's extra loss terms."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    common = dict(logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                  hidden_states=getattr(outputs, "hidden_states", None), attentions=getattr(outputs, "attentions", None))
    if family.moe is None:
        return CausalLMOutputWithPast(loss=loss, **common)
    aux = None
    if with_aux and getattr(outputs, "router_logits", None) is not None:
        aux, coef = aux_term(family, causal_lm, outputs, attention_mask)
        loss = loss + coef * aux.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, router_logits=getattr(outputs, "router_logits", None),
                                     **common)
