"""Launch one LLaMA-Factory training (as llamafactory/launcher.py) with a timing and memory callback:

    torchrun --nproc_per_node N bench/lf_bench_launch.py sft.yaml result.json

Per step, rank 0's wall time (device-synchronised), peak ``max_memory_allocated`` (in the step, before it -- at step 1
the set-up -- and per phase), the unrounded losses ``training_step`` returned (mean over ranks) and every rank's
peak; save_model is skipped. Environment: ``LF_BENCH_LIGER_LOSS_ONLY=1`` (CPU smoke: Liger's fused loss only, its
other kernels do not run interpreted); ``LF_BENCH_TWIN=s`` (the CPU memory twin,
bench/common.py: CPU allocation peaks, ``live_at_peak`` / ``live_at_setup``); ``LF_BENCH_PROFILE=k`` (step k under the
torch profiler, bench/step_profile.py: ``profile``)."""

import json
import os
import sys

import torch
from torch.autograd.profiler import record_function
from transformers import TrainerCallback

import step_profile
from common import TWIN_ENV, AllocationTimeline, StepClock, peak_mib, twin_peaks, twin_setup


PHASES: dict = {}  # forward / backward peaks of the current step (see main)
FORWARD: list = []  # the open "## forward" mark of the current micro-batch


class BenchCallback(TrainerCallback):
    def __init__(self, out, micro_losses):
        self.out, self.steps, self.losses, self.clock = out, [], [], StepClock()
        self.micro_losses = micro_losses  # filled by the training_step wrapper
        self.step_losses = []
        self.run_peak = 0.0
        self.phase = {}
        self.twin_prof = None  # LF_BENCH_TWIN: the run's allocation profile
        self.prof = self.profile = None  # LF_BENCH_PROFILE (bench/step_profile.py)

    def on_step_begin(self, args, state, control, **kw):
        self.prof = step_profile.start() if step_profile.wanted() == state.global_step + 1 else None
        self.clock.begin()  # the peak since the last step's optimizer step; at step 1: the set-up
        self.run_peak = max(self.run_peak, self.clock.before)
        self.phase = {"before_peak_mib": self.clock.before}
        PHASES.clear()
        self.micro_losses.clear()

    # peak memory by phase: forward+backward (all micro-batches), then the optimizer step
    def on_pre_optimizer_step(self, args, state, control, **kw):
        rest = peak_mib(reset=True)  # since the last backward: gradient clipping
        self.phase.update(PHASES)
        PHASES.clear()
        self.phase["fwd_bwd_peak_mib"] = max(rest, self.phase.get("forward_peak_mib", 0.0), self.phase.get("backward_peak_mib", 0.0))
        self.run_peak = max(self.run_peak, self.phase["fwd_bwd_peak_mib"])

    def on_optimizer_step(self, args, state, control, **kw):
        self.phase["optimizer_peak_mib"] = peak_mib(reset=True)
        self.run_peak = max(self.run_peak, self.phase["optimizer_peak_mib"])

    def on_step_end(self, args, state, control, **kw):
        elapsed, peak = self.clock.end()
        if self.prof is not None:  # LF_BENCH_PROFILE: this step's time is left out of tokens/s
            self.profile, self.phase["profiled"] = step_profile.summary(self.prof, elapsed), True
        self.run_peak = max(self.run_peak, peak)
        self.steps.append({"s": elapsed, "peak_mib": self.run_peak, **self.phase,
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


def main():
    yaml_path, out = sys.argv[1], sys.argv[2]
    sys.argv = [sys.argv[0], yaml_path]
    import transformers.trainer

    transformers.trainer.Trainer.save_model = lambda self, *a, **k: None
    micro = []
    training_step = transformers.trainer.Trainer.training_step

    def recording_step(self, *args, **kwargs):
        FORWARD.append(record_function("## forward"))  # the twin's forward window: to the backward call
        FORWARD[-1].__enter__()
        loss = training_step(self, *args, **kwargs)
        micro.append(float(loss.detach().float()))
        return loss

    transformers.trainer.Trainer.training_step = recording_step
    twin = int(os.environ.get(TWIN_ENV, "0") or 0)
    if twin:
        print(f"[lf_bench] twin 1/{twin}: {', '.join(twin_setup(twin))}", flush=True)
    # split the forward+backward peak: forward (to the loss) vs backward (accelerator.backward)
    import accelerate

    backward = accelerate.Accelerator.backward

    def timed_backward(self, loss, **kwargs):
        while FORWARD:
            FORWARD.pop().__exit__(None, None, None)
        PHASES["forward_peak_mib"] = max(PHASES.get("forward_peak_mib", 0.0), peak_mib(reset=True))
        out = backward(self, loss, **kwargs)
        PHASES["backward_peak_mib"] = max(PHASES.get("backward_peak_mib", 0.0), peak_mib(reset=True))
        return out

    accelerate.Accelerator.backward = timed_backward
    if os.environ.get("LF_BENCH_LIGER_LOSS_ONLY") == "1":
        _liger_loss_only()
    if step_profile.wanted():
        step_profile.install()
    from llamafactory.train.tuner import run_exp

    callback = BenchCallback(out, micro)
    if twin:  # stopped and read in on_train_end (a CPU test shim may end the process at LLaMA-Factory's teardown)
        cpu = [torch.profiler.ProfilerActivity.CPU]
        callback.twin_prof = torch.profiler.profile(activities=cpu, profile_memory=True)
        callback.twin_prof.__enter__()
    run_exp(callbacks=[callback])


if __name__ == "__main__":
    main()
