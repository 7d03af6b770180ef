"""A torchrun script: LLaMA-Factory v1 trainings one after another in each rank's one Python process, through v1's own
Python API (``run_sft`` / ``run_rm`` / ``run_dpo`` with a dict), as a sweep script would run them.

    torchrun ... tests/support/v1_runs.py RUNS.json    # RUNS.json: [{"command": "rm", "args": {...}}, ...]

Each run is framed by ``[v1_runs] run I COMMAND start (RANK R, LOCAL_RANK L)`` / ``done`` lines on stderr, and after its ``fit`` every rank
says how its model was sharded: ``[v1_runs] run I rank R: FSDP2 units N, CPU-offloaded M``. v1's runs end by
destroying the process group; here only the last one does (the others would leave the next without one)."""

import json
import os
import sys


def main(path: str) -> None:
    import torch.distributed as dist
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.core.base_trainer import BaseTrainer
    from torch.distributed.fsdp import FSDPModule

    runs = json.loads(open(path).read())
    current = {"run": -1}
    fit = BaseTrainer.fit

    def fit_and_tell(self, *args, **kwargs):
        out = fit(self, *args, **kwargs)
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in units]
        offloaded = sum(1 for g in groups if g is not None and all(p.offload_to_cpu for p in g.fsdp_params))
        print(f"[v1_runs] run {current['run']} rank {dist.get_rank()}: FSDP2 units {len(units)}, CPU-offloaded "
              f"{offloaded}", file=sys.stderr, flush=True)
        return out

    BaseTrainer.fit = fit_and_tell
    destroy = DistributedInterface.destroy
    DistributedInterface.destroy = lambda self: None
    for i, run in enumerate(runs):
        current["run"] = i
        print(f"[v1_runs] run {i} {run['command']} start (RANK {os.environ.get('RANK')}, LOCAL_RANK "
              f"{os.environ.get('LOCAL_RANK')})", file=sys.stderr, flush=True)
        entry(run["command"])(dict(run["args"]))
        print(f"[v1_runs] run {i} {run['command']} done", file=sys.stderr, flush=True)
    destroy(DistributedInterface())


def entry(command: str):
    if command == "sft":
        from llamafactory.v1.trainers.sft_trainer import run_sft

        return run_sft
    if command == "rm":
        from llamafactory.v1.trainers.rm_trainer import run_rm

        return run_rm
    from llamafactory.v1.trainers.dpo_trainer import run_dpo

    return run_dpo


if __name__ == "__main__":
    main(sys.argv[1])
