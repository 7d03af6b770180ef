"""Tiny configs of every family (transformers 5.6 config classes, random weights) and their batches.

``TEXT``: extra config keys per text model type (on top of the shared small sizes). ``VLM``: a builder
per vision-language model type returning ``(config, inputs)`` with images made here: row 1 is padded
(attention 0) with labels kept on the padding, so Gemma 3's masked mean and the MoE aux mask matter. Gemma 3 and PaliGemma carry a text softcap their
classes must NOT apply.
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN = 384, 64
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            output_router_logits=True, router_aux_loss_coef=0.05)
_MLA = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4)
_LINEAR_ATTN = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
_GRANITE_MOE = dict(_MOE, logits_scaling=4.0, output_router_logits=False, shared_intermediate_size=32)

TEXT = {
    **{t: {} for t in ("glm", "glm4", "olmo", "olmo2", "olmo3", "smollm3", "starcoder2", "ministral", "ministral3")},
    "gemma4_text": dict(final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"],
                        global_head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                        num_kv_shared_layers=0, sliding_window=16),
    "granite": dict(logits_scaling=4.0),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(logit_scale=0.25),
    "phi": dict(partial_rotary_factor=0.5),  # lm_head has a bias
    "gpt_neox": dict(rotary_pct=0.25),  # head `embed_out`, decoder `gpt_neox`
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=32),
    "olmoe": _MOE, "flex_olmo": _MOE,
    "phimoe": dict(_MOE, lm_head_bias=True),
    "gpt_oss": dict(_MOE, layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": _GRANITE_MOE, "granitemoeshared": _GRANITE_MOE,
    "granitemoehybrid": dict(_GRANITE_MOE, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_n_groups=1, mamba_expand=1),
    "qwen3_next": dict(_MOE, shared_expert_intermediate_size=32, full_attention_interval=2, **_LINEAR_ATTN),
    "deepseek_v2": dict(_MOE, **_MLA), "deepseek_v3": dict(_MOE, **_MLA), "glm4_moe_lite": dict(_MOE, **_MLA),
    "glm4_moe": dict(_MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "llama4_text": dict(_MOE, intermediate_size_mlp=128, interleave_moe_layer_step=1, no_rope_layers=[1, 1],
                        attention_chunk_size=64),
    "qwen3_5_text": dict(_LINEAR_ATTN),
    "qwen3_5_moe_text": dict(_MOE, shared_expert_intermediate_size=32, **_LINEAR_ATTN),
}
TEXT_BASE = dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)

IMG, VID, VS, VE = 250, 251, 252, 253


def _text(**kw) -> dict:
    out = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, **TEXT_BASE)
    out.update(kw)
    return out


def _rows(middle: list[int], t0: int = 6, t1: int = 6, seed: int = 0):
    """Two rows ``[text t0][middle][text t1]``; row 1 ends 3 positions early (padding that keeps its labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.cat([torch.randint(3, 200, (t0,), generator=g), torch.tensor(middle),
                                  torch.randint(3, 200, (t1,), generator=g)]) for _ in range(2)])
    am = torch.ones_like(ids)
    am[1, -3:] = 0
    labels = ids.clone()
    labels[:, : t0 + len(middle)] = -100
    return ids, am, labels


def _qwen_like(t: str, seed: int):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    patch = 16 if t.startswith("qwen3") else 14
    vis = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=HIDDEN, patch_size=patch,
               spatial_merge_size=2, temporal_patch_size=2)
    if t == "qwen2_vl":
        vis = dict(depth=2, embed_dim=32, hidden_size=HIDDEN, num_heads=4, patch_size=patch, spatial_merge_size=2,
                   temporal_patch_size=2)
    elif t == "qwen2_5_vl":
        vis.update(fullatt_block_indexes=[1], window_size=56)
    elif t.startswith("qwen3"):
        vis.update(num_position_embeddings=16, **({"deepstack_visual_indexes": [0]} if "vl" in t else {}))
    else:
        vis.update(image_size=56)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    txt = _text(rope_parameters=rope)
    if t.startswith("qwen3_vl"):
        rope["mrope_interleaved"] = True
    if t.startswith("qwen3_5"):
        txt.update(_LINEAR_ATTN)
        rope.update(mrope_section=[1, 1, 2], mrope_interleaved=True, partial_rotary_factor=0.5)
    if t.startswith("glm4"):
        rope.update(mrope_section=[2, 1, 1], partial_rotary_factor=0.5)
    if t.endswith("moe"):
        txt.update(_MOE, n_routed_experts=4, shared_expert_intermediate_size=32, n_shared_experts=1,
                   first_k_dense_replace=1, n_group=1, topk_group=1)
    ids_kw = (dict(image_start_token_id=VS, image_end_token_id=VE, video_start_token_id=254, video_end_token_id=255)
              if t.startswith("glm4") else dict(vision_start_token_id=VS, vision_end_token_id=VE))
    cfg = CONFIG_MAPPING[t](text_config=txt, vision_config=vis, image_token_id=IMG, video_token_id=VID, **ids_kw)
    grids = [(1, 4, 4), (1, 4, 4)]
    ids, am, labels = _rows([VS] + [IMG] * 4 + [VE], seed=seed)
    pixels = torch.randn(32, 3 * 2 * patch * patch, generator=torch.Generator().manual_seed(seed + 1))
    inputs = dict(input_ids=ids, attention_mask=am, pixel_values=pixels, image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=(ids == IMG).long(), labels=labels)
    if t.endswith("moe"):
        inputs["output_router_logits"] = True  # these classes add the aux loss for the kwarg only
    return cfg, inputs


def _vision(**kw) -> dict:
    return dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4), **kw)


# 69 lines on purpose: one branch per vision-language / MoE family's config, read top to bottom as a table.
def _other(t: str, seed: int):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    g = torch.Generator().manual_seed(seed + 1)
    c = CONFIG_MAPPING[t]
    if t == "llava":
        cfg = c(text_config=dict(_text(), model_type="llama"), image_token_index=IMG, image_seq_length=4,
                vision_config=_vision(model_type="clip_vision_model", num_hidden_layers=2, image_size=28, patch_size=14,
                                      projection_dim=32))
        ids, am, labels = _rows([IMG] * 4, seed=seed)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, pixel_values=torch.randn(2, 3, 28, 28, generator=g))
    if t == "internvl":
        cfg = c(text_config=dict(_text(), model_type="qwen2"), image_token_id=IMG, image_seq_length=4,
                vision_config=_vision(num_hidden_layers=2, image_size=[56, 56], patch_size=[14, 14]))
        ids, am, labels = _rows([IMG] * 4, seed=seed)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, pixel_values=torch.randn(2, 3, 56, 56, generator=g))
    if t == "mistral3":
        cfg = c(text_config=dict(_text(), model_type="mistral"), image_token_index=IMG, spatial_merge_size=2,
                vision_config=_vision(head_dim=8, image_size=56, patch_size=14))
        ids, am, labels = _rows([IMG] * 4, seed=seed)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, image_sizes=torch.tensor([[56, 56]] * 2),
                         pixel_values=torch.randn(2, 3, 56, 56, generator=g))
    if t == "paligemma":
        cfg = c(text_config=dict(_text(final_logit_softcapping=3.0), model_type="gemma"), image_token_index=IMG, projection_dim=HIDDEN,
                hidden_size=HIDDEN, vision_config=_vision(image_size=28, patch_size=14, projection_dim=HIDDEN))
        ids, am, labels = _rows([IMG] * 4, t0=0, seed=seed)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, token_type_ids=(labels != -100).long(),
                         pixel_values=torch.randn(2, 3, 28, 28, generator=g))
    if t == "gemma3":
        cfg = c(text_config=_text(final_logit_softcapping=3.0), mm_tokens_per_image=4, image_token_index=IMG,
                boi_token_index=VS, eoi_token_index=VE, vision_config=_vision(image_size=32, patch_size=8))
        ids, am, labels = _rows([VS] + [IMG] * 4 + [VE], seed=seed)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, token_type_ids=(ids == IMG).long(),
                         pixel_values=torch.randn(2, 3, 32, 32, generator=g))
    if t == "mllama":
        cfg = c(text_config=dict(_text(), cross_attention_layers=[1]), image_token_index=IMG,
                vision_config=dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                                   intermediate_size=64, vision_output_dim=64, image_size=28, patch_size=14,
                                   max_num_tiles=2, intermediate_layers_indices=[0],
                                   supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]))
        ids, am, labels = _rows([IMG], seed=seed)
        cam = torch.zeros(*ids.shape, 1, 2, dtype=torch.long)
        cam[:, 6:, :, :1] = 1
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, aspect_ratio_ids=torch.tensor([[1], [1]]),
                         pixel_values=torch.randn(2, 1, 2, 3, 28, 28, generator=g), cross_attention_mask=cam,
                         aspect_ratio_mask=torch.tensor([[[1, 0]], [[1, 0]]]))
    if t == "gemma4":
        txt = _text(final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"],
                    global_head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                    num_kv_shared_layers=0, sliding_window=16)
        cfg = c(text_config=txt, image_token_id=IMG, boi_token_id=VS, eoi_token_id=VE, video_token_id=VID,
                audio_token_id=249, boa_token_id=248, eoa_token_index=247,
                vision_config=_vision(num_key_value_heads=4, head_dim=8, patch_size=4, pooling_kernel_size=3,
                                      position_embedding_size=64))
        ids, am, labels = _rows([VS] + [IMG] * 4 + [VE], seed=seed)
        xs, ys = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="xy")
        pos = torch.stack([xs.flatten(), ys.flatten()], -1)[None].repeat(2, 1, 1)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, image_position_ids=pos,
                         mm_token_type_ids=(ids == IMG).long(), pixel_values=torch.randn(2, 36, 48, generator=g))
    if t == "llama4":
        txt = _text(intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                    no_rope_layers=[1, 1], attention_chunk_size=64)
        cfg = c(text_config=txt, image_token_index=IMG, boi_token_index=VS, eoi_token_index=VE,
                vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                   vision_output_dim=32, image_size=28, patch_size=14, pixel_shuffle_ratio=0.5,
                                   projector_input_dim=32, projector_output_dim=32))
        ids, am, labels = _rows([VS, IMG, VE], seed=seed)
        return cfg, dict(input_ids=ids, attention_mask=am, labels=labels, pixel_values=torch.randn(2, 3, 28, 28, generator=g))
    raise KeyError(t)


_QWEN_LIKE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe",
              "glm46v")
VLM = {t: _qwen_like for t in _QWEN_LIKE} | {
    t: _other for t in ("llava", "internvl", "mistral3", "paligemma", "gemma3", "mllama", "gemma4", "llama4")}
