"""CUDA check of the FSDP2 adapter checkpoint path (llamafactory_liger_fsdp.checkpoint), one GPU
(runs on CPU/gloo too, for a smoke test).

The CPU suite tests save/resume through `llamafactory-cli` on 2 gloo ranks; this runs the same two
functions on CUDA parameters (NCCL, world size 1, bf16 compute) with the image's own
transformers/peft/accelerate: LoRA + modules_to_save embed_tokens/lm_head, fully_shard, one
optimizer step, save, scramble the adapter, load, and compare every adapter tensor (must be
bit-equal), then one more step runs on the reloaded shards. Prints one JSON line; exits 1 on a mismatch.

    python3 bench/gpu_checkpoint_check.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist



def main() -> int:
    from peft import get_peft_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from llamafactory_liger_fsdp import testing as tiny
    from llamafactory_liger_fsdp.checkpoint import repair as checkpoint
    from llamafactory_liger_fsdp.engage import engage

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = tiny.make_peft(tiny.make_model("llama"), "mts").to(dev)
    engage(model, backend="triton" if cuda else "torch")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = {k: v.to(dev) for k, v in tiny.make_batch(batch=2, seq=32).items()}

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    step()
    before = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in get_peft_model_state_dict(model).items()}
    plugin = SimpleNamespace(fsdp_version=2, state_dict_type="StateDictType.FULL_STATE_DICT")
    acc = SimpleNamespace(process_index=0, wait_for_everyone=dist.barrier)
    unexpected = lambda *a, **k: (_ for _ in ()).throw(AssertionError("delegated"))  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        checkpoint.make_save(unexpected)(plugin, acc, model, d, adapter_only=True)
        saved = torch.load(os.path.join(d, "pytorch_model_fsdp.bin"), weights_only=True)
        plain = all(type(v) is torch.Tensor and v.device.type == "cpu" for v in saved.values())
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(1.0)
        checkpoint.make_load(unexpected)(plugin, acc, model, d, adapter_only=True)
    after = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
             for k, v in get_peft_model_state_dict(model).items()}
    worst = max((after[k].float() - before[k].float()).abs().max().item() for k in before)
    out = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", keys=len(before), saved_plain_cpu_tensors=plain,
               max_abs_diff_after_load=worst, loss_next_step=step(),
               sharded=all(isinstance(p, DTensor) for p in model.parameters()))
    print(json.dumps(out))
    dist.destroy_process_group()
    return 0 if (plain and worst == 0.0 and out["sharded"]) else 1


if __name__ == "__main__":
    sys.exit(main())
