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
