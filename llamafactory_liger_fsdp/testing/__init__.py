"""Tiny random models of every family, built from a config (nothing downloaded), PEFT set-ups and
batches: what the tests, the 2-process workers and the benchmarks compare against.

``FAMILY_CONFIGS`` is the core set (text models, the shared parity tests); ``ALL`` names every tiny model
(:mod:`.configs`: every text and vision-language family); :func:`make_inputs` gives a batch for any of them.
``cpu_fsdp_shim/`` and ``cpu_v1_shim/`` are directories a CPU run puts on PYTHONPATH (their ``sitecustomize``: accelerate
shards on CPU ranks; v1's step-end synchronize is skipped without a GPU), for tests/ and bench/ alike;
:mod:`.memory_twin` is the CPU memory twin's side inside a launched run (a GPU run's peak from a CPU run at 1/s sizes).
"""

from __future__ import annotations

import copy

import torch

from .configs import TEXT, TEXT_BASE, VLM

VOCAB = 384
HIDDEN = 64

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attention_dropout=0.0,
)

FAMILY_CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen2_tied": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False, head_dim=16),
    "phi3": dict(tie_word_embeddings=False, pad_token_id=0),
    "gemma": dict(head_dim=16),  # ties embeddings by default
    "gemma2": dict(head_dim=16, final_logit_softcapping=3.0, sliding_window=16, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, final_logit_softcapping=3.0, sliding_window=16, query_pre_attn_scalar=16),
    "mixtral": dict(
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.05, sliding_window=None,
    ),
    "qwen3_moe": dict(
        tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        output_router_logits=True, router_aux_loss_coef=0.05, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}
ALL = sorted(set(FAMILY_CONFIGS) | set(TEXT) | set(VLM))


def model_type_of(name: str) -> str:
    return "qwen2" if name == "qwen2_tied" else name


def make_config(name: str):
    from transformers import AutoConfig

    if name in VLM:
        config = VLM[name](name, 0)[0]
    else:
        cfg = dict(_COMMON)
        cfg.update(FAMILY_CONFIGS[name] if name in FAMILY_CONFIGS else dict(TEXT_BASE, **TEXT[name]))
        config = AutoConfig.for_model(model_type_of(name), **cfg)
    config._attn_implementation = "eager"
    return config


def make_model(name: str, seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if name in VLM else AutoModelForCausalLM
    model = auto.from_config(make_config(name), torch_dtype=dtype)
    # larger-than-default init so the loss has real curvature at V=384
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif p.dim() == 1 and model.get_output_embeddings().bias is p:
                p.normal_(0.0, 0.5)  # a head bias that matters
    model.tie_weights()
    return model


def make_inputs(name: str, seed: int = 0) -> dict:
    """A training batch (labels included) for any tiny model: images for the vision-language ones."""
    return VLM[name](name, seed)[1] if name in VLM else make_batch(seed=seed)


LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "query_key_value"]


def _leaf_name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module).rsplit(".", 1)[-1]


def make_peft(model, head: str, dropout: float = 0.0, seed: int = 1):
    """head: 'mts' (modules_to_save head + input embeddings), 'lora' (LoRA on the head), 'full' (no PEFT)."""
    if head == "full":
        return model
    from peft import LoraConfig, get_peft_model

    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in LINEAR_TARGETS]
    head_name = _leaf_name(model, model.get_output_embeddings())
    kwargs = dict(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False)
    if head == "mts":
        embed = _leaf_name(model, model.get_input_embeddings())
        cfg = LoraConfig(target_modules=targets, modules_to_save=[head_name, embed], **kwargs)
    elif head == "lora":
        cfg = LoraConfig(target_modules=targets + [head_name], **kwargs)
    else:
        raise ValueError(head)
    torch.manual_seed(seed)
    return get_peft_model(model, cfg)


def make_batch(batch: int = 2, seq: int = 12, seed: int = 0, ignore_frac: float = 0.25):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = -100
    labels[:, :2] = -100  # a "prompt"
    attn = torch.ones(batch, seq, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def twin(name: str, head: str, seed: int = 0, dropout: float = 0.0):
    """Two identical models: (reference, candidate)."""
    ref = make_peft(make_model(name, seed), head, dropout)
    cand = copy.deepcopy(ref)
    return ref, cand


def rel(a, b) -> float:
    """``||a - b|| / ||b||`` in float64: the one relative difference of the tests, the workers and the benchmarks.
    ``a`` and ``b`` are tensors (any dtype and device) or anything ``torch.as_tensor`` takes; ``||b||`` is floored at
    1e-300, so two zero tensors differ by 0 and anything nonzero against zero by a huge number."""
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
