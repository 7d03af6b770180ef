"""Launch one LLaMA-Factory v1 training (``sft`` or ``dpo``, as v1's ``run_sft`` / ``run_dpo``) with a timing and
memory callback:

    torchrun --nproc_per_node N bench/v1_launch.py sft|dpo cfg.yaml result.json

Every rank (rank r > 0 to ``result.json.rank<r>``), per step: wall time, peak ``max_memory_allocated`` in and before
it, v1's step loss and the step's tokens; v1's save_model is skipped. ``LF_BENCH_TWIN=s``: the CPU memory twin
(bench/common.py). ``LF_BENCH_LAYER_UNITS=1``: v1's FSDP2 layer finder answers as git main's (the plugin's
``integration.v1.layers.patch_finder``): each decoder layer a unit where LLaMA-Factory 0.9.5 makes the model one.
"""

import contextlib
import gc
import inspect
import json
import os
import sys

import torch
import yaml
from torch.autograd.profiler import record_function

from common import LAYER_UNITS_ENV, TWIN_ENV, AllocationTimeline, StepClock, twin_peaks, twin_setup


def main() -> None:
    command, cfg_path, out_path = sys.argv[1:4]
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.data_engine import DataEngine
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.utils.callbacks import TrainerCallback

    if command == "dpo":
        from llamafactory.v1.trainers.dpo_trainer import DPOTrainer as Trainer
    else:
        from llamafactory.v1.trainers.sft_trainer import SFTTrainer as Trainer

    steps, tokens = [], [0]

    class Timed(Trainer):
        def compute_loss(self, batch):
            tokens[0] += int((batch["attention_mask"] != 0).sum())
            with record_function("## forward"):
                return super().compute_loss(batch)

    class Timer(TrainerCallback):
        clock = StepClock()

        def on_step_begin(self, args, state, **kwargs):
            if twin:  # the twin: what reference cycles still hold from the last step goes now, not at random
                gc.collect()
            tokens[0] = 0
            self.clock.begin()

        def on_step_end(self, args, state, **kwargs):
            seconds, peak = self.clock.end()
            steps.append({"s": seconds, "peak_mib": peak, "before_peak_mib": self.clock.before,
                          "loss": float(state.loss), "tokens": tokens[0]})

    twin = int(os.environ.get(TWIN_ENV, "0") or 0)
    if os.environ.get(LAYER_UNITS_ENV) == "1":  # v1 plain with each decoder layer a unit, as git main wraps it
        from llamafactory_liger_fsdp.integration.v1 import layers

        layers.patch_finder()
    extra = {"twin_constants": twin_setup(twin)} if twin else {}
    profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                if twin else contextlib.nullcontext())
    with open(cfg_path, encoding="utf-8") as f:
        model_args, data_args, training_args, _ = get_args(yaml.safe_load(f))
    # 0.9.5 builds it from the dist_config, git main from the training arguments (as their run_sft do)
    takes_args = "training_args" in inspect.signature(DistributedInterface.__init__).parameters
    DistributedInterface(training_args if takes_args else training_args.dist_config)
    with profiler:
        dataset = DataEngine(data_args.train_dataset)
        engine = ModelEngine(model_args, is_train=True)
        trainer = Timed(args=training_args, model=engine.model, renderer=engine.renderer, train_dataset=dataset,
                        callbacks=[Timer()])
        trainer.fit()
    if twin:
        extra["live_at_peak"], extra["live_at_setup"] = twin_peaks(AllocationTimeline(profiler), steps)
    rank = DistributedInterface().get_rank()
    with open(out_path if rank == 0 else f"{out_path}.rank{rank}", "w") as f:  # every rank its own peaks
        json.dump({"steps": steps, **extra}, f)
    DistributedInterface().destroy()


if __name__ == "__main__":
    main()
