"""llamafactory-liger-fsdp: an exact fused lm_head loss for LLaMA-Factory under FSDP, DDP or one device.

Module map (nothing imports anything above it; docs/design.md has the why):

* ``_bootstrap``   -- the import hook a ``.pth`` file installs in every process; imports no torch.
* ``integration/`` -- EVERY patch of third-party code (LLaMA-Factory parser/loader/launcher, accelerate, Trainer).
* ``config`` (the keys), ``refusals`` (what cannot work, decided from the arguments), ``sharding`` (decided once).
* ``engage``       -- engage/disengage a model and the engaged line; ``forward`` -- the one generic forward.
* ``losses``       -- WHERE THE LOSS IS COMPUTED; ``heads/`` -- one strategy per head kind;
  ``gather``       -- WHERE A HEAD WEIGHT IS GATHERED; ``wrapping`` -- the head as its own FSDP unit.
* ``families`` (quirks as data), ``checkpoint/`` (resume safety, FSDP2 adapter repair), ``diagnostics``, ``doctor``.
* ``ops/``         -- ``fused_linear_cross_entropy`` (Triton kernel, torch oracle); knows nothing of FSDP/PEFT.

Importing the package imports no torch (the ``.pth`` hook imports it in every process).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "engage", "fused_linear_cross_entropy"]


def __getattr__(name):
    if name == "fused_linear_cross_entropy":
        from .ops import fused_linear_cross_entropy

        return fused_linear_cross_entropy
    if name == "engage":
        from .engage import engage

        return engage
    raise AttributeError(name)
