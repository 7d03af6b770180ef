"""Every family the plugin supports, one device, fp32, tiny config from transformers' own config class (random weights):
loss and every trainable gradient of the engaged model equal the original forward's (rel <= 1e-5) for a
modules_to_save head and a LoRA head, with the MoE aux loss on, images for the vision-language models, and a
``num_items_in_batch`` that differs from the label count (honoured or ignored as the model does). The step-1
guard runs in each (it is on by default) and must report the slice exact. Refused families by their reason.
(The core text families are in test_single_parity.py.)"""

import dataclasses

import pytest
import torch

from llamafactory_liger_fsdp import families
from llamafactory_liger_fsdp.config import LigerFsdpConfig, LigerFsdpConfigError
from llamafactory_liger_fsdp.engage import engage
from llamafactory_liger_fsdp.testing import ALL, FAMILY_CONFIGS, make_inputs, make_model, rel, twin
from llamafactory_liger_fsdp.testing.configs import VLM
from support import names_key_and_fix

TOL = 1e-5
REFUSED = {"llama4"}
NEW = [n for n in ALL if n not in FAMILY_CONFIGS and n not in REFUSED]


def _num_items(batch):
    return torch.tensor(int((batch["labels"][:, 1:] != -100).sum()) * 2)


def _check(ref, cand, name, capsys):
    batch = dict(make_inputs(name), num_items_in_batch=None)
    batch["num_items_in_batch"] = _num_items(batch)
    torch.manual_seed(0)
    out_ref = ref(**batch)
    torch.manual_seed(0)
    out = cand(**batch)
    assert "[liger_fsdp] guard: step 1 exact: model's own loss" in capsys.readouterr().err
    assert out.logits is None
    assert abs(out.loss.item() - out_ref.loss.item()) <= TOL * abs(out_ref.loss.item()), (out.loss, out_ref.loss)
    if families.FAMILIES[name].moe is not None:
        assert out.aux_loss is not None and abs(out.aux_loss.item() - out_ref.aux_loss.item()) <= 1e-6
    out_ref.loss.backward()
    out.loss.backward()
    grads = {n: p.grad for n, p in cand.named_parameters() if p.requires_grad}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            if p.grad is None:
                assert grads[n] is None, n
                continue
            assert grads[n] is not None and rel(grads[n], p.grad) <= TOL, (n, rel(grads[n], p.grad))


@pytest.mark.parametrize("kind", ["mts", "lora"])
@pytest.mark.parametrize("name", NEW)
def test_family_parity(name, kind, capsys):
    ref, cand = twin(name, kind)
    ref.train(), cand.train()
    done = engage(cand, backend="torch")
    assert done is not None and done.family.model_type == name
    _check(ref, cand, name, capsys)


def test_vlm_full_fine_tuning_reaches_the_vision_tower(capsys):
    """Full fine-tuning of Qwen2-VL: the vision tower and projector get the original's gradients (the pixel
    values flow through the decoder call untouched), so LLaMA-Factory's freeze_* flags keep their meaning."""
    ref, cand = twin("qwen2_vl", "full")
    engage(cand, backend="torch")
    _check(ref, cand, "qwen2_vl", capsys)
    assert cand.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


PLANTED = [("granite", dict(scale=None)), ("cohere", dict(scale=None)), ("gemma4_text", dict(softcap=None)),
           ("gemma4", dict(softcap=None)), ("gemma3", dict(loss="mean")), ("qwen3_vl", dict(loss="causal_lm")),
           ("gemma3", dict(softcap="text_config.final_logit_softcapping"))]


@pytest.mark.parametrize("name,planted", PLANTED)
def test_quirks_matter(name, planted, monkeypatch):
    """Each quirk changes the loss of its tiny model, else the parity tests could not see it missing (Gemma 3
    carries a text softcap that its class must not apply)."""
    monkeypatch.setitem(families.FAMILIES, name, dataclasses.replace(families.FAMILIES[name], **planted))
    ref, cand = twin(name, "full")
    engage(cand, LigerFsdpConfig(enabled=True, backend="torch", guard=False))
    batch = make_inputs(name)
    batch["num_items_in_batch"] = _num_items(batch)
    lr, lc = ref(**batch).loss.item(), cand(**batch).loss.item()
    assert abs(lc - lr) > 1e-4 * abs(lr), (name, lc, lr)


def test_head_bias_enters_exactly():
    ref, cand = twin("phi", "mts")
    head = cand.base_model.model.lm_head.modules_to_save["default"]
    assert head.bias is not None and head.bias.requires_grad
    engage(cand, backend="torch")
    batch = make_inputs("phi")
    cand(**batch).loss.backward(), ref(**batch).loss.backward()
    ref_bias = ref.base_model.model.lm_head.modules_to_save["default"].bias.grad
    assert head.bias.grad.abs().sum() > 0 and rel(head.bias.grad, ref_bias) <= TOL


def test_llama4_refused_with_its_reason():
    model = make_model("llama4")
    with pytest.raises(LigerFsdpConfigError) as exc:
        engage(model, backend="torch")
    assert "merges the image features itself" in str(exc.value)
    names_key_and_fix(str(exc.value), "liger_fsdp", "remove")


def test_granitemoe_aux_refused():
    from llamafactory_liger_fsdp.testing import make_config

    config = make_config("granitemoe")
    config.output_router_logits = True
    with pytest.raises(LigerFsdpConfigError) as exc:
        families.family_of("granitemoe", config)
    assert "never record router logits" in str(exc.value)
    names_key_and_fix(str(exc.value), "liger_fsdp", "moe_aux_loss_coef")


def test_other_class_refused_even_under_the_upstream_name():
    """Remote code often keeps the upstream class name; the class object transformers maps the type to decides."""
    import transformers

    remote = type("LlamaForCausalLM", (transformers.LlamaForCausalLM,), {"__module__": "transformers_modules.acme"})
    for cls in (remote, type("MyRemoteLlamaForCausalLM", (torch.nn.Module,), {})):
        with pytest.raises(LigerFsdpConfigError) as exc:
            families.family_of("llama", None, cls)
        assert "transformers' LlamaForCausalLM" in str(exc.value) and cls.__module__ in str(exc.value)
        names_key_and_fix(str(exc.value), "liger_fsdp", "remove")
    assert families.family_of("llama", None, transformers.LlamaForCausalLM).cls == "LlamaForCausalLM"


def test_issue_list_is_covered():
    """Every model type the issue lists is supported or refused with its own reason (none is unknown)."""
    wanted = ("gemma gemma2 gemma3 gemma3_text glm glm4 glm4v granite llama llava mistral mixtral mllama olmo2 paligemma "
              "phi3 qwen2 qwen2_vl qwen2_5_vl qwen3 qwen3_moe qwen3_next qwen3_5 gpt_oss qwen2_moe qwen3_vl qwen3_vl_moe "
              "qwen3_5_moe deepseek_v3 glm4_moe llama4 cohere cohere2 internvl mistral3 olmo3 smollm3 gemma4 starcoder2 "
              "phi gpt_neox llama4_text").split()
    assert not [t for t in wanted if t not in families.FAMILIES]
    assert all(t in ALL for t in wanted), [t for t in wanted if t not in ALL and t != "qwen2"]
    assert set(VLM) <= set(families.FAMILIES)


def test_doctor_names_family_class_quirks_guard_and_label_smoothing(tmp_path, monkeypatch):
    """`doctor` on a vision-language yaml and a scaled-logits one: the class LLaMA-Factory builds, the quirks,
    the guard, and that label smoothing bypasses the fused path."""
    import yaml

    from llamafactory_liger_fsdp import doctor
    from llamafactory_liger_fsdp._log import logger
    from llamafactory_liger_fsdp.testing import make_config

    monkeypatch.setattr(logger, "level", logger.level)  # doctor quiets the plugin's log; later tests read it

    def run(name, **extra):
        make_config(name).save_pretrained(tmp_path / name)
        y = dict(model_name_or_path=str(tmp_path / name), stage="sft", do_train=True, finetuning_type="lora",
                 lora_target="all", additional_target="embed_tokens,lm_head", dataset="x", dataset_dir=str(tmp_path),
                 template="qwen2_vl", output_dir=str(tmp_path / "out"), use_cpu=True, liger_fsdp=True, **extra)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(y))
        ok, lines = doctor.check_yaml(str(tmp_path / f"{name}.yaml"))
        assert ok, lines
        return "\n".join(lines)

    out = run("qwen2_vl", label_smoothing_factor=0.1)
    assert "model class Qwen2VLForConditionalGeneration" in out and "guard on" in out
    assert "label_smoothing_factor 0.1: the fused kernel computes the smoothed loss for causal-LM classes; for " \
        "image-text classes the Trainer smooths" in out and "will engage: head=modules_to_save" in out
    out = run("granite", liger_fsdp_guard=False)
    assert "model type granite (quirks: logits / 4 (config.logits_scaling))." in out and "guard off" in out
