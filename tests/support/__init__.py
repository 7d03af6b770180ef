"""Shared helpers of the test suite (never imported by bench/ or the package).

* :mod:`.cli` -- tiny local assets and real ``llamafactory-cli train`` runs (2 CPU ranks, FSDP via the shim).
* :func:`names_key_and_fix` -- what every refusal must say: the key, and a fix.
Tiny models live in ``llamafactory_liger_fsdp.testing`` (the benchmarks use them too).
"""

from __future__ import annotations


def names_key_and_fix(message: str, key: str, *fix_words: str) -> None:
    """``message`` names ``key`` (in backticks) and has one ``Fix:`` that mentions every word of ``fix_words``."""
    assert f"`{key}" in message, f"the key `{key}` is not named: {message}"
    assert message.count("Fix:") == 1, f"no single fix: {message}"
    fix = message.split("Fix:", 1)[1]
    for word in fix_words:
        assert word in fix, f"the fix does not mention {word!r}: {message}"


def sft_args(assets, tmp_path) -> dict:
    """A LoRA SFT run of the tiny local model, as LLaMA-Factory's parser takes it (the refusal tests' base)."""
    return dict(
        model_name_or_path=str(assets / "model"), stage="sft", do_train=True, finetuning_type="lora",
        dataset="tiny_alpaca", dataset_dir=str(assets / "data"), template="llama3", output_dir=str(tmp_path / "out"),
        report_to="none",
    )


def train_args(args: dict):
    """LLaMA-Factory's ``get_train_args`` on ``args`` (the plugin's parser patches in place)."""
    from llamafactory.hparams import get_train_args

    return get_train_args(args)
