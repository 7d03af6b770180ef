"""llamafactory-liger-fsdp: an exact, FSDP-safe fused lm_head loss for LLaMA-Factory.

Layers, top to bottom (nothing imports anything above it):

* ``_bootstrap``  -- import-time hook installed by a ``.pth`` file; imports no torch.
* ``integration`` -- every patch of third-party code (LLaMA-Factory parser and loader, accelerate's FSDP wrap policies).
* ``head``        -- the generic causal-LM forward; the loss is computed in ``head.head_loss``.
* ``wrapping``    -- the head as its own FSDP unit; the call *through* the unit (where weights are gathered).
* ``families``    -- per-family quirks (softcap, MoE aux loss); ``config`` -- the yaml keys and error texts.
* ``ops``         -- ``fused_linear_cross_entropy`` (triton kernel, torch oracle); knows nothing of FSDP/PEFT.

This file stays light: importing the package must not import torch (the ``.pth`` hook imports it
in every process).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "engage", "fused_linear_cross_entropy"]


def __getattr__(name):
    if name == "fused_linear_cross_entropy":
        from .ops import fused_linear_cross_entropy

        return fused_linear_cross_entropy
    if name == "engage":
        from .head import engage

        return engage
    raise AttributeError(name)
