"""Launch one LLaMA-Factory training with a timing and memory callback, its steps to ``result.json``:

    torchrun --nproc_per_node N bench/lf_bench_launch.py cfg.yaml result.json            # as llamafactory/launcher.py
    torchrun --nproc_per_node N bench/lf_bench_launch.py v1 sft|dpo cfg.yaml result.json  # v1, as its run_sft / run_dpo

Per step: wall time (device-synchronised), the Triton kernels it compiled, peak ``max_memory_allocated`` in and
before it (step 1: the set-up); no model saved. LLaMA-Factory: rank 0 writes, with per-phase peaks, the unrounded
losses (mean over ranks) and each rank's peak. v1: each rank writes (rank r > 0 to ``result.json.rank<r>``), with
v1's step loss and tokens.
Environment: ``LF_BENCH_TWIN=s`` (the CPU memory twin, llamafactory_liger_fsdp/testing/memory_twin.py);
``LF_BENCH_LIGER_LOSS_ONLY=1`` (CPU smoke: Liger's fused loss alone runs interpreted); ``LF_BENCH_PROFILE=k`` (step
k's torch profile, bench/step_profile.py); ``LF_BENCH_CARD_GIB=g`` (the allocator held to g GiB: an 80 GB card's
on a larger one); ``LF_BENCH_LAYER_UNITS=1`` (v1: each decoder layer an FSDP2 unit, as git main wraps it)."""

import contextlib
import gc
import inspect
import json
import os
import sys

import torch
from torch.autograd.profiler import record_function
from transformers import TrainerCallback

import step_profile
from common import CAP_ENV, LAYER_UNITS_ENV, TWIN_ENV, StepClock, peak_mib
from llamafactory_liger_fsdp.testing.memory_twin import AllocationTimeline, twin_peaks, twin_setup

PHASES: dict = {}  # forward / backward peaks of the current step (see timed_backward)
FORWARD: list = []  # the open "## forward" mark of the current micro-batch


def twin_scale() -> int:
    """The CPU memory twin's s (0: no twin)."""
    return int(os.environ.get(TWIN_ENV, "0") or 0)


def twin_profiler():
    """The twin's profile of every CPU allocation (read by memory_twin.AllocationTimeline)."""
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


# ---------------------------------------------------------------------------------------------------------- LLaMA-Factory
class BenchCallback(TrainerCallback):
    def __init__(self, out, micro_losses):
        self.out, self.steps, self.losses, self.clock = out, [], [], StepClock()
        self.micro_losses, self.step_losses = micro_losses, []  # micro_losses: filled by the training_step wrapper
        self.run_peak, self.phase = 0.0, {}
        self.twin_prof = None  # LF_BENCH_TWIN: the run's allocation profile
        self.prof = self.profile = None  # LF_BENCH_PROFILE (bench/step_profile.py)
        self.compiles = step_profile.Compiles()  # Triton compiles per step

    def on_step_begin(self, args, state, control, **kw):
        self.prof = step_profile.start() if step_profile.wanted() == state.global_step + 1 else None
        self.clock.begin()  # the peak since the last step's optimizer step; at step 1: the set-up
        self.phase = {"before_peak_mib": self.clock.before}
        PHASES.clear()
        self.micro_losses.clear()

    # peak memory by phase: forward+backward (all micro-batches, and since the last backward: clipping), optimizer
    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.phase.update(PHASES, fwd_bwd_peak_mib=max(peak_mib(reset=True), *PHASES.values()))
        PHASES.clear()

    def on_optimizer_step(self, args, state, control, **kw):
        self.phase["optimizer_peak_mib"] = peak_mib(reset=True)

    def on_step_end(self, args, state, control, **kw):
        elapsed, peak = self.clock.end()
        if self.prof is not None:  # LF_BENCH_PROFILE: this step's time is left out of tokens/s
            self.profile, self.phase["profiled"] = step_profile.summary(self.prof, elapsed), True
        self.run_peak = max(self.run_peak, peak, *(v for k, v in self.phase.items() if k.endswith("_peak_mib")))
        self.steps.append({"s": elapsed, "peak_mib": self.run_peak, **self.phase, "compiles": self.compiles.take(),
                           "tokens_seen": int(getattr(state, "num_input_tokens_seen", 0) or 0)})
        self.step_losses.append(sum(self.micro_losses))

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, args, state, control, **kw):
        import torch.distributed as dist
        live = live_setup = None
        if self.twin_prof is not None:  # the CPU peaks replace the (zero) CUDA ones
            self.twin_prof.__exit__(None, None, None)
            live, live_setup = twin_peaks(AllocationTimeline(self.twin_prof), self.steps)
        mine = {"step_losses": self.step_losses, "peak_mib": max((s["peak_mib"] for s in self.steps), default=0.0)}
        every = [mine]
        if dist.is_available() and dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        if int(os.environ.get("RANK", "0")) == 0:
            n = min(len(r["step_losses"]) for r in every)
            with open(self.out, "w") as f:
                json.dump({"steps": self.steps, "losses": self.losses,
                           "live_at_peak": live, "live_at_setup": live_setup, "profile": self.profile,
                           "step_losses": [sum(r["step_losses"][i] for r in every) / len(every) for i in range(n)],
                           "peak_mib_per_rank": [r["peak_mib"] for r in every]}, f)


def _liger_loss_only():
    import functools

    import liger_kernel.transformers as lt
    for name in [n for n in getattr(lt, "__all__", dir(lt)) if n.startswith("apply_liger_kernel_to_")]:
        fn = getattr(lt, name)  # the package exports these lazily (module __getattr__)
        setattr(lt, name, functools.partial(fn, rope=False, rms_norm=False, swiglu=False))


def _record_micro_steps(micro: list) -> None:
    """Trainer.training_step appends each micro-batch's loss to ``micro`` and opens the twin's ``## forward`` window;
    accelerate's backward closes it and splits the step's peak: forward (to the loss) vs backward."""
    import accelerate
    import transformers.trainer
    training_step, backward = transformers.trainer.Trainer.training_step, accelerate.Accelerator.backward

    def recording_step(self, *args, **kwargs):
        FORWARD.append(record_function("## forward"))
        FORWARD[-1].__enter__()
        loss = training_step(self, *args, **kwargs)
        micro.append(float(loss.detach().float()))
        return loss

    def timed_backward(self, loss, **kwargs):
        while FORWARD:
            FORWARD.pop().__exit__(None, None, None)
        PHASES["forward_peak_mib"] = max(PHASES.get("forward_peak_mib", 0.0), peak_mib(reset=True))
        out = backward(self, loss, **kwargs)
        PHASES["backward_peak_mib"] = max(PHASES.get("backward_peak_mib", 0.0), peak_mib(reset=True))
        return out

    transformers.trainer.Trainer.training_step = recording_step
    accelerate.Accelerator.backward = timed_backward


def run_lf(yaml_path: str, out: str) -> None:
    """One LLaMA-Factory training (``run_exp``) with :class:`BenchCallback`; save_model skipped."""
    import transformers.trainer
    sys.argv = [sys.argv[0], yaml_path]
    transformers.trainer.Trainer.save_model = lambda self, *a, **k: None
    micro = []
    _record_micro_steps(micro)
    twin = twin_scale()
    if twin:
        print(f"[lf_bench] twin 1/{twin}: {', '.join(twin_setup(twin))}", flush=True)
    if os.environ.get("LF_BENCH_LIGER_LOSS_ONLY") == "1":
        _liger_loss_only()
    if step_profile.wanted():
        step_profile.install()
    from llamafactory.train.tuner import run_exp
    callback = BenchCallback(out, micro)
    if twin:  # stopped and read in on_train_end (a CPU test shim may end the process at LLaMA-Factory's teardown)
        callback.twin_prof = twin_profiler()
        callback.twin_prof.__enter__()
    run_exp(callbacks=[callback])


# ---------------------------------------------------------------------------------------------------------- v1
def run_v1(command: str, cfg_path: str, out_path: str) -> None:
    """One v1 training (``sft`` or ``dpo``: its trainer's ``fit``) with a step timer; every rank writes its steps."""
    import yaml
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.data_engine import DataEngine
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.utils.callbacks import TrainerCallback as V1Callback
    if command == "dpo":
        from llamafactory.v1.trainers.dpo_trainer import DPOTrainer as Trainer
    else:
        from llamafactory.v1.trainers.sft_trainer import SFTTrainer as Trainer
    steps, tokens, twin = [], [0], twin_scale()

    class Timed(Trainer):
        def compute_loss(self, batch):
            tokens[0] += int((batch["attention_mask"] != 0).sum())
            with record_function("## forward"):
                return super().compute_loss(batch)

    class Timer(V1Callback):
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

    if os.environ.get(LAYER_UNITS_ENV) == "1":  # v1 plain with each decoder layer a unit, as git main wraps it
        from llamafactory_liger_fsdp.integration.v1 import layers
        layers.patch_finder()
    extra = {"twin_constants": twin_setup(twin)} if twin else {}
    profiler = twin_profiler() if twin else contextlib.nullcontext()
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
    if cap := float(os.environ.get(CAP_ENV) or 0):  # an 80 GB card's allocator on a larger card (common.card() says so)
        dev = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.mem_get_info(dev)[1], dev)
    if sys.argv[1] == "v1":
        run_v1(*sys.argv[2:5])
    else:
        run_lf(*sys.argv[1:3])
