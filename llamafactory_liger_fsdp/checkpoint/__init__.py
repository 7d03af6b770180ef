"""Checkpoints: what a LoRA + trained-head run saves, resumes from and exports.

* :mod:`.resume` -- never resume from a half-written checkpoint; FSDP2 adapter runs write their adapter
  (``FULL_STATE_DICT``). Generic: applies with ``liger_fsdp: true`` whatever the stack.
* :mod:`.repair` -- FSDP2 adapter save/load as full tensors, only where the installed accelerate
  (< 1.15) writes rank 0's shards; its own switch, ``liger_fsdp_checkpoint_repair`` (default true).
"""
