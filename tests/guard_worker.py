"""2-process worker (gloo, CPU) for the first-step guard's collective decisions, under FSDP2.

Cases (each on a fresh model, every rank):

* ``mixed``: FSDP2 with accelerate's bf16 mixed precision (``param_dtype`` and ``output_dtype`` bf16, fp32 master
  shards), the trained head its own unit: the guard's fp32 head mode must leave FSDP2's own casts of the shards alone
  and pass ("exact"), and the step must train.
* ``labels_on_one_rank``: rank 0's micro-batch has no labelled position, rank 1's has: checked on step 1, not deferred.
* ``fails_on_one_rank`` (alone in its run): the model's own forward raises on rank 1 only: rank 1 leaves with its own
  error unchanged (a note says where), no collective after it, and the launcher (here ``support.dist.spawn``, through
  ``torch.multiprocessing``) stops rank 0 -- no hang, no mismatched collective.
* ``bad_ids_on_one_rank``: a token id beyond the embedding on rank 1 only: every rank stops with the data error.

Run: python tests/guard_worker.py OUT.json CASE [CASE ...]
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.dist import spawn  # noqa: E402


def _sharded(mixed: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from llamafactory_liger_fsdp import wrapping
    from llamafactory_liger_fsdp.config import LigerFsdpConfig
    from llamafactory_liger_fsdp.engage import engage
    from llamafactory_liger_fsdp.testing import make_model, make_peft

    model = make_peft(make_model("llama", seed=0), "mts")
    engage(model, LigerFsdpConfig(enabled=True, backend="torch"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     output_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
    wrapping.shard_marked_units(model, mesh=mesh, mp_policy=mp_policy)
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def run_case(case: str, rank: int) -> dict:
    from llamafactory_liger_fsdp.testing import make_batch

    model = _sharded(case == "mixed")
    batch = make_batch(seed=rank)
    if case == "labels_on_one_rank" and rank == 0:
        batch["labels"][:] = -100
    if case == "bad_ids_on_one_rank" and rank == 1:
        batch["input_ids"][0, 3] = 10_000
    if case == "fails_on_one_rank" and rank == 1:
        decoder = model.get_base_model().model
        original = decoder.forward
        calls = []

        def first_call_fails(*args, **kwargs):  # the guard's own forward is the first decoder call
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("CUDA out of memory (planted on rank 1)")
            return original(*args, **kwargs)

        decoder.forward = first_call_fails
    from llamafactory_liger_fsdp import _log

    lines = []
    handler = _log.logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    _log.logger.addHandler(handler)
    try:
        loss = model(**batch).loss
        loss.backward()
        out = {"case": case, "loss": float(loss), "finite_grads": all(
            torch.isfinite(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).all().item()
            for p in model.parameters() if p.grad is not None)}
    except Exception as exc:
        if case == "fails_on_one_rank":
            raise
        out = {"case": case, "error_type": type(exc).__name__, "error": str(exc)[:600],
               "notes": list(getattr(exc, "__notes__", []))}
    finally:
        _log.logger.removeHandler(handler)
    out["guard_lines"] = [l for l in lines if "guard:" in l]
    return out


def _rank(rank: int, world: int, cases: list[str]) -> list[dict]:
    results = []
    for case in cases:
        if case == "fails_on_one_rank":  # as in training: the error leaves the process (no collective after it)
            try:
                run_case(case, rank)
            except Exception as exc:
                print(f"rank {rank}: {type(exc).__name__}: {exc} | notes: {getattr(exc, '__notes__', [])}",
                      file=sys.stderr, flush=True)
                os._exit(3)
        try:
            results.append(run_case(case, rank))
        except Exception:
            results.append({"case": case, "worker_error": traceback.format_exc()})
    return results


if __name__ == "__main__":
    spawn(_rank, (sys.argv[2:],), out=sys.argv[1])
