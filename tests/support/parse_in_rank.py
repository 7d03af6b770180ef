"""Run under torchrun: parse a yaml (plus overrides) the way a training rank does and print the plugin's
decisions as one JSON line. Used for recipes LLaMA-Factory only parses inside a distributed launch (DeepSpeed)."""

import json
import sys

from llamafactory.hparams import get_train_args

from llamafactory_liger_fsdp import config

sys.argv = ["llamafactory-cli", *sys.argv[1:]]
_, _, training_args, finetuning_args, _ = get_train_args()
cfg = config.get_config(finetuning_args)
print("PARSED " + json.dumps({"enabled": cfg.enabled, "sharding": cfg.sharding.label, "stage": finetuning_args.stage}))
