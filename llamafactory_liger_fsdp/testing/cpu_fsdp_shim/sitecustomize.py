"""TEST-ONLY shim: let accelerate run FSDP on CPU ranks (gloo).

accelerate switches to DistributedType.FSDP only for GPU-like devices; on CPU it silently trains
plain DDP even with an FSDP config (accelerate/state.py picks FSDP for GPU-like devices only). Tests put this directory on
PYTHONPATH so every process of a `llamafactory-cli train` run (the torchrun workers included)
forces the FSDP type whenever an FSDP plugin was given. The tests then assert that the model
really is sharded (FSDP units / DTensor parameters) -- this shim alone proves nothing.

Test support only: tests/ (tests/support/cli.py) and bench/'s CPU runs (bench/common.py's ``shim``) put this directory
on PYTHONPATH; the package never imports it.
"""

import os
import sys

from llamafactory_liger_fsdp._import_hook import after_import


def _patch_state(state_mod):
    """What FSDP on CPU ranks needs once accelerate's state module has loaded (four patches, each below)."""
    _force_fsdp(state_mod)
    _fsdp1_cpu_device()
    _no_offload_of_full_state_dicts()
    _leave_together()


def _force_fsdp(state_mod):
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


def _fsdp1_cpu_device():
    """FSDP1 wants device_id `cpu`, accelerate passes its device `cpu:<rank>`."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp_init = FullyShardedDataParallel.__init__

    def fsdp1_init(self, module, *args, **kwargs):
        dev = kwargs.get("device_id")
        if isinstance(dev, torch.device) and dev.type == "cpu":
            kwargs["device_id"] = torch.device("cpu")
        fsdp_init(self, module, *args, **kwargs)

    FullyShardedDataParallel.__init__ = fsdp1_init


def _no_offload_of_full_state_dicts():
    """FSDP1 full state dicts with offload_to_cpu=True break when the params already live on the CPU (storage of
    size 0); on CPU ranks the offload is a no-op anyway, so turn it off."""
    from torch.distributed.fsdp import FullStateDictConfig

    fsd_init = FullStateDictConfig.__init__

    def full_sd_init(self, *args, **kwargs):
        fsd_init(self, *args, **kwargs)
        self.offload_to_cpu = False

    FullStateDictConfig.__init__ = full_sd_init


def _leave_together():
    """gloo teardown race (seen in CI): a rank that destroys its process group while the peer's gloo threads still
    finish the last op aborts at exit ("terminate called without an active exception", SIGABRT). LLaMA-Factory's
    run_exp calls destroy_process_group as the very last step of a successful run, so leave together (barrier),
    destroy, and skip C++ static destructors. A failing run raises before this point and keeps its exit code."""
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


after_import("cpu_fsdp_shim", {"accelerate.state"}, _patch_state)

if os.environ.get("CPU_FSDP_SHIM_SKIP_SAVE") == "1":
    # FSDP1 + PEFT modules_to_save cannot gather a full state dict on CPU/gloo (rank 0 issues a
    # collective from inside PEFT's save_pretrained that rank 1 never joins), with or without the
    # plugin. FSDP1 end-to-end tests therefore skip the final save; FSDP2 tests save for real.
    import transformers.trainer

    def _no_save(self, *args, **kwargs):
        print("[cpu_fsdp_shim] final save skipped (FSDP1 on CPU)", file=sys.stderr)

    transformers.trainer.Trainer.save_model = _no_save


if os.environ.get("CPU_FSDP_SHIM_LOGITS"):
    # After training, run the trained (still sharded) model in eval on fixed token ids -- every
    # rank takes part, FSDP2 forwards are collective -- and rank 0 saves the logits. The tests
    # compare them with the saved adapter loaded into a plain PEFT model in one process.
    import transformers.trainer

    _train = transformers.trainer.Trainer.train

    def _train_then_dump(self, *args, **kwargs):
        result = _train(self, *args, **kwargs)
        import torch

        model = self.model_wrapped if self.model_wrapped is not None else self.model
        ids = torch.randint(0, self.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        model.train(was_training)
        if os.environ.get("RANK", "0") == "0":
            torch.save({"input_ids": ids, "logits": logits}, os.environ["CPU_FSDP_SHIM_LOGITS"])
        return result

    transformers.trainer.Trainer.train = _train_then_dump

if os.environ.get("CPU_FSDP_SHIM_KILL"):
    # Kill one rank with SIGKILL (no cleanup, like an OOM kill or a lost node):
    #   "step:S:R" -- rank R inside optimizer step S (its first training_step call);
    #   "save:S:R" -- rank R while saving checkpoint-S, after the weights and optimizer, right
    #                 before trainer_state.json (what the Trainer writes last).
    import signal

    import transformers.trainer
    import transformers.trainer_callback

    _what, _step, _rank = os.environ["CPU_FSDP_SHIM_KILL"].split(":")
    _step, _me = int(_step), os.environ.get("RANK", "0") == _rank

    def _die():
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if _what == "step":
        _training_step = transformers.trainer.Trainer.training_step

        def _training_step_or_die(self, *args, **kwargs):
            if _me and self.state.global_step == _step - 1:
                print(f"[cpu_fsdp_shim] killing rank {_rank} in step {_step}", file=sys.stderr)
                _die()
            return _training_step(self, *args, **kwargs)

        transformers.trainer.Trainer.training_step = _training_step_or_die
    elif _what == "save":
        _save_to_json = transformers.trainer_callback.TrainerState.save_to_json

        def _save_to_json_or_die(self, json_path):
            if _me and os.path.basename(os.path.dirname(json_path)) == f"checkpoint-{_step}":
                print(f"[cpu_fsdp_shim] killing rank {_rank} while saving checkpoint-{_step}", file=sys.stderr)
                _die()
            return _save_to_json(self, json_path)

        transformers.trainer_callback.TrainerState.save_to_json = _save_to_json_or_die

if os.environ.get("CPU_SHIM_FAKE_BF16_GPU") == "1":
    # transformers refuses `bf16: true` without a GPU unless `use_cpu` is set, and `use_cpu` makes DeepSpeed count
    # world size 1. DeepSpeed's bf16 mode itself runs on CPU ranks; this lets a test reach it.
    import transformers.training_args

    transformers.training_args.is_torch_bf16_gpu_available = lambda *a, **k: True

if os.environ.get("CPU_SHIM_COMPUTE_DTYPE") == "1":
    # The unfused baseline of a bf16 ZeRO-3 run under the plugin's dtype policy (trainable parameters in the compute
    # dtype, as DeepSpeed casts them itself under ZeRO-0/1/2): applied to a run without the plugin.
    import importlib

    _sft = importlib.import_module("llamafactory.train.sft.workflow")
    _load_model = _sft.load_model

    def _load_in_compute_dtype(*args, **kwargs):
        from llamafactory_liger_fsdp import precision

        model = _load_model(*args, **kwargs)
        print(f"[cpu_fsdp_shim] compute dtype: {precision.to_compute_dtype(model)[0]}", file=sys.stderr)
        return model

    _sft.load_model = _load_in_compute_dtype
