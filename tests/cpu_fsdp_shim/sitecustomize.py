"""TEST-ONLY shim: let accelerate run FSDP on CPU ranks (gloo).

accelerate switches to DistributedType.FSDP only for GPU-like devices; on CPU it silently trains
plain DDP even with an FSDP config (see shared CPU_TESTING.md). Tests put this directory on
PYTHONPATH so every process of a `llamafactory-cli train` run (the torchrun workers included)
forces the FSDP type whenever an FSDP plugin was given. The tests then assert that the model
really is sharded (FSDP units / DTensor parameters) -- this shim alone proves nothing.

Never used outside tests/.
"""

import importlib.abc
import os
import sys


def _patch_state(state_mod):
    import inspect

    from accelerate.utils import DistributedType

    cls = state_mod.AcceleratorState
    original = cls.__init__
    sig = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # Every AcceleratorState() re-copies PartialState's MULTI_CPU type, so re-apply each time.
        bound = sig.bind_partial(self, *args, **kwargs).arguments
        plugin = bound.get("fsdp_plugin") or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            first = getattr(self, "fsdp_plugin", None) is None
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            if first:
                if self._mixed_precision != "no":
                    plugin.set_mixed_precision(self._mixed_precision)
                print(f"[cpu_fsdp_shim] forced DistributedType.FSDP (fsdp_version={plugin.fsdp_version})", file=sys.stderr)

    cls.__init__ = __init__

    # FSDP1 wants device_id `cpu`, accelerate passes its device `cpu:<rank>`.
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp_init = FullyShardedDataParallel.__init__

    def fsdp1_init(self, module, *args, **kwargs):
        dev = kwargs.get("device_id")
        if isinstance(dev, torch.device) and dev.type == "cpu":
            kwargs["device_id"] = torch.device("cpu")
        fsdp_init(self, module, *args, **kwargs)

    FullyShardedDataParallel.__init__ = fsdp1_init

    # FSDP1 full state dicts with offload_to_cpu=True break when the params already live on the
    # CPU (storage of size 0); on CPU ranks the offload is a no-op anyway, so turn it off.
    from torch.distributed.fsdp import FullStateDictConfig

    fsd_init = FullStateDictConfig.__init__

    def full_sd_init(self, *args, **kwargs):
        fsd_init(self, *args, **kwargs)
        self.offload_to_cpu = False

    FullStateDictConfig.__init__ = full_sd_init

    # gloo teardown race (seen in CI): a rank that destroys its process group while the peer's
    # gloo threads still finish the last op aborts at exit ("terminate called without an active
    # exception", SIGABRT). LLaMA-Factory's run_exp calls destroy_process_group as the very last
    # step of a successful run, so leave together (barrier), destroy, and skip C++ static
    # destructors. A failing run raises before this point and keeps its exit code.
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_and_exit(group=None):
        if group is not None or not dist.is_initialized():
            return destroy(group)
        dist.barrier()
        destroy()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    dist.destroy_process_group = destroy_and_exit


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch_state(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "accelerate.state":
            return None
        for f in sys.meta_path:
            if f is self or not hasattr(f, "find_spec"):
                continue
            spec = f.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())

if os.environ.get("CPU_FSDP_SHIM_SKIP_SAVE") == "1":
    # FSDP1 + PEFT modules_to_save cannot gather a full state dict on CPU/gloo (rank 0 issues a
    # collective from inside PEFT's save_pretrained that rank 1 never joins), with or without the
    # plugin. FSDP1 end-to-end tests therefore skip the final save; FSDP2 tests save for real.
    import transformers.trainer

    def _no_save(self, *args, **kwargs):
        print("[cpu_fsdp_shim] final save skipped (FSDP1 on CPU)", file=sys.stderr)

    transformers.trainer.Trainer.save_model = _no_save
