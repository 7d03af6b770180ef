"""The LLaMA-Factory modules (and accelerate's launch command) the plugin patches: the hooked ones right after each executes (:mod:`.integration`).

Names only: the import hook (:mod:`._bootstrap`) reads them at every interpreter start, so this module imports nothing.
"""

PARSER = "llamafactory.hparams.parser"
LOADER = "llamafactory.model.loader"
LAUNCHER = "llamafactory.launcher"
# USE_V1=1, the v1 engine (torchrun ranks run its launcher as __main__: they are reached through the other two)
V1_LAUNCHER = "llamafactory.v1.launcher"
V1_PARSER = "llamafactory.v1.config.arg_parser"
V1_KERNELS = "llamafactory.v1.plugins.model_plugins.kernels.interface"
# `accelerate launch`: the accelerate CLI's launch command (refusals before any rank starts)
ACCELERATE_LAUNCH = "accelerate.commands.launch"
TORCHRUN = "torch.distributed.run"  # torchrun's (and accelerate launch's) elastic launch

MODULES = frozenset((PARSER, LOADER, LAUNCHER, V1_LAUNCHER, V1_PARSER, V1_KERNELS, ACCELERATE_LAUNCH, TORCHRUN))

# Patched later, by a run of their stage only (imported then, not hooked at import).
DPO = "llamafactory.train.dpo.trainer"
KTO = "llamafactory.train.kto.trainer"
V1_DPO = "llamafactory.v1.trainers.dpo_trainer"  # imported by `llamafactory-cli dpo` before the model is built
