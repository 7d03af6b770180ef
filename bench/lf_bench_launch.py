"""Launch one LLaMA-Factory training (like llamafactory/launcher.py) with a timing/memory callback.

    torchrun --nproc_per_node 1 bench/lf_bench_launch.py sft.yaml result.json

Records per step: wall time (CUDA-synchronised) and torch.cuda.max_memory_allocated(); writes
them and the per-step losses to result.json. The final save_model is skipped (benchmark only:
writing multi-GB embed/head copies says nothing about the loss)."""

import json
import os
import sys
import time

import torch
from transformers import TrainerCallback


class BenchCallback(TrainerCallback):
    def __init__(self, out):
        self.out, self.steps, self.losses, self.t0 = out, [], [], None

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.steps.append({"s": time.perf_counter() - self.t0, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                           "tokens_seen": int(getattr(state, "num_input_tokens_seen", 0) or 0)})

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, args, state, control, **kw):
        if int(os.environ.get("RANK", "0")) == 0:
            with open(self.out, "w") as f:
                json.dump({"steps": self.steps, "losses": self.losses}, f)


def main():
    yaml_path, out = sys.argv[1], sys.argv[2]
    sys.argv = [sys.argv[0], yaml_path]
    import transformers.trainer

    transformers.trainer.Trainer.save_model = lambda self, *a, **k: None
    from llamafactory.train.tuner import run_exp

    run_exp(callbacks=[BenchCallback(out)])


if __name__ == "__main__":
    main()
