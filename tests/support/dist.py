"""Helpers of the multi-process workers (tests/fsdp_worker.py, tests/ds_worker.py and the QLoRA worker) and of the
tests that read their results."""

from __future__ import annotations

import json
import os
import sys


def finish(results, out: str) -> None:
    """Gather every rank's results to rank 0's ``out``, leave the last collective together, and exit without C++
    static destructors: a rank that tears gloo down while its peer still has a pending send/recv thread aborts with
    "terminate called without an active exception" (seen in CI); everything worth keeping is written first."""
    import torch.distributed as dist

    try:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def reference_step(ref, batches: list) -> list[float]:
    """The unsharded, unfused reference's share of one data-parallel step: the mean of every rank's loss, backward in
    one process (as FSDP / DeepSpeed average the gradients over ranks); returns each rank's loss."""
    losses = []
    for batch in batches:
        loss = ref(**batch).loss / len(batches)
        loss.backward()
        losses.append(float(loss) * len(batches))
    return losses


def assert_parity(result: dict, tol: float) -> None:
    """A worker case against the unsharded single-process unfused reference: loss and every trainable gradient
    after step 1, every parameter after the last step, and training really moved the weights."""
    assert "error" not in result, result["error"]
    assert result["loss_rel"] <= tol, result
    bad = {n: r for n, r in result["grad_rels"].items() if not r <= tol}
    assert not bad, f"gradients differ from the unsharded reference: {bad}"
    assert result["param_rels_after"] <= tol, result
    assert result["moved"] > 1e-3, "training did not move the weights; the comparison would be vacuous"
