"""LLaMA-Factory's v1 engine (``USE_V1=1``), in one place: :mod:`.engine` (its launcher, ``get_args`` and kernel
registry; engaging a model), :mod:`.train` (``compute_log_probs``, FSDP2's ``fully_shard``), :mod:`.dpo` (v1's DPO
trainer), :mod:`.cp` (Ulysses sequence parallelism's loss), :mod:`.args` and :mod:`.cp_args` (a v1 yaml's keys and
refusals; torch-free), :mod:`.doctor` (``doctor`` on a v1 yaml)."""
