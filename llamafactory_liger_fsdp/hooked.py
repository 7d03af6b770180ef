"""The LLaMA-Factory modules the plugin patches: the hooked ones right after each executes (:mod:`.integration`).

Names only: the import hook (:mod:`._bootstrap`) reads them at every interpreter start, so this module imports nothing.
"""

PARSER = "llamafactory.hparams.parser"
LOADER = "llamafactory.model.loader"
LAUNCHER = "llamafactory.launcher"
V1_LAUNCHER = "llamafactory.v1.launcher"  # USE_V1=1: the v1 engine (refused: it never calls load_model)

MODULES = frozenset((PARSER, LOADER, LAUNCHER, V1_LAUNCHER))

# Patched later, by a run of their stage only (imported then, not hooked at import).
DPO = "llamafactory.train.dpo.trainer"
KTO = "llamafactory.train.kto.trainer"
