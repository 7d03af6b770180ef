"""The one multi-process harness of the tests: :func:`spawn` starts the ranks of every launcher (tests/fsdp_worker.py,
tests/ds_worker.py, tests/guard_worker.py and the QLoRA launcher in tests/test_families_qlora.py), :func:`launch` runs
a launcher from a test in a fresh interpreter and :func:`every_rank` reads what its ranks returned; plus what the parity
tests share (:func:`reference_step`, :func:`assert_parity`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


class RankFailed(RuntimeError):
    """A rank exited with an error (its traceback, or its exit code, in the message); the other ranks were stopped."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args: tuple = (), *, out: str | os.PathLike | None = None, world: int = 2, init: bool = True,
          env: dict[str, str] | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes (``spawn``), on the CPU: each rank gets
    ``MASTER_ADDR``/``MASTER_PORT`` (a free port), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``OMP_NUM_THREADS=1`` (one
    torch thread) and ``env``, then a gloo process group (``init=False``: ``fn`` makes its own from that environment,
    e.g. ``deepspeed.init_distributed``). What ``fn`` returns is gathered from every rank to ``out`` (JSON, rank
    order) and returned here. ``fn`` must be importable by the children (a module-level function, ``__main__``'s too).

    A rank that raises or exits non-zero stops the others (torch.multiprocessing's launcher terminates them; nothing
    hangs in a collective) and :class:`RankFailed` carries that rank's traceback (or exit code) out of here, so a
    launcher run as a script exits non-zero with it on stderr."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = str(out) if out is not None else os.path.join(tmp, "out.json")
        try:
            mp.start_processes(_rank, args=(fn, world, free_port(), tuple(args), init, dict(env or {}), path),
                               nprocs=world, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise RankFailed(f"rank {exc.error_index} of {world} (pid {exc.error_pid}) failed: {exc.msg.strip()}") from None
        with open(path) as f:
            return json.load(f)


def _rank(rank: int, fn, world: int, port: int, args: tuple, init: bool, env: dict, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **env})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    _finish(fn(rank, world, *args), out)


def _finish(results, out: str) -> None:
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


NATIVE_CRASH = ("terminated with signal SIGSEGV", "terminated with signal SIGBUS", "terminated with signal SIGABRT")


def launch(script: str | os.PathLike, *argv, timeout: float | None, env: dict[str, str] | None = None):
    """Run a launcher (``script``: a path, or a file name in tests/) as ``python script ARGV...`` in a fresh
    interpreter, with ``OMP_NUM_THREADS=1`` and ``env``; returns the finished ``subprocess.CompletedProcess``.

    A rank killed by a native crash (SIGSEGV / SIGBUS / SIGABRT: no Python traceback; seen once in 2 CPU gloo ranks,
    not reproduced in later runs of the same job) reruns the whole job once, with a warning carrying the first
    attempt's tail; the rerun's result stands, so a crash that repeats, and every Python error, still fails."""
    def run():
        return subprocess.run([sys.executable, str(TESTS / script), *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    proc = run()
    if proc.returncode != 0 and any(crash in proc.stderr for crash in NATIVE_CRASH):
        import warnings

        warnings.warn(f"{script}: a rank crashed natively; rerunning the job once. First attempt's tail:\n"
                      f"{proc.stderr[-1500:]}")
        proc = run()
    return proc


def every_rank(proc, out: str | os.PathLike) -> list:
    """Every rank's results (rank order) of a launcher that exited 0; otherwise the assertion shows its output's
    tail, the failing rank's traceback included."""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(Path(out).read_text())


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
