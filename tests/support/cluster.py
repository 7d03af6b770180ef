"""v1 trainings on CPU gloo ranks launched as a cluster would launch them: one ``torchrun`` per "node" on this host
(``--nnodes N --node-rank I --nproc-per-node P``, static rendezvous at 127.0.0.1), every process running
tests/support/v1_runs.py (several v1 runs one after another in one Python process). A launch that outlives its
timeout -- a rank waiting in a collective the others never enter -- is killed whole (every torchrun's process group,
its ranks included) and reported as such: a hang fails the test instead of blocking it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .dist import free_port
from .v1 import SHIM as V1_SHIM

RUNS = Path(__file__).resolve().parent / "v1_runs.py"
RUN_LINE = re.compile(r"\[v1_runs\] run (\d+) (\w+) (start|done)")


@dataclass
class Launch:
    rc: int  # the first non-zero exit code of the torchruns (0: all exited 0)
    log: str  # every node's output, node by node
    timed_out: bool
    seconds: float

    def run_log(self, i: int) -> str:
        """The lines of run ``i`` (every node's), from its ``start`` to its ``done`` or the node's end."""
        keep, lines = None, []
        for line in self.log.splitlines():
            hit = RUN_LINE.search(line)
            if hit and hit.group(3) == "start":
                keep = int(hit.group(1)) == i
            if keep:
                lines.append(line)
            if line.startswith("==== node "):
                keep = None
        return "\n".join(lines)

    def first_errors(self, n: int = 12) -> str:
        """The first lines that say why a rank failed (gloo's collective mismatch, a Python exception)."""
        hits = [line for line in self.log.splitlines() if re.search(r"Error: |what\(\)|enforce fail", line)]
        return "\n".join(hits[:n])

    def done(self, i: int) -> bool:
        return bool(re.search(rf"\[v1_runs\] run {i} \w+ done", self.log))


def torchrun_nodes(runs: list[tuple[str, dict]], *, nnodes: int, nproc: int, timeout: float, shims: tuple = (),
                   env: dict | None = None) -> Launch:
    """``runs`` (command, v1 args) in every process of ``nnodes`` torchruns of ``nproc`` CPU ranks each; ``shims``:
    directories put before the v1 CPU shim on ``PYTHONPATH``."""
    tmp = Path(tempfile.mkdtemp(prefix="v1_nodes_"))
    spec = tmp / "runs.json"
    spec.write_text(json.dumps([{"command": c, "args": a} for c, a in runs]))
    port = free_port()
    full_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                    PYTHONPATH=os.pathsep.join([*map(str, shims), str(V1_SHIM), os.environ.get("PYTHONPATH", "")]),
                    **(env or {}))
    for key in ("LLAMAFACTORY_LIGER_FSDP_SAID_DISABLED", "LLAMAFACTORY_LIGER_FSDP_SAID_VERSIONS"):
        full_env.pop(key, None)
    procs, outs, t0 = [], [], time.time()
    for node in range(nnodes):
        out = open(tmp / f"node{node}.log", "w+")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port), str(RUNS),
               str(spec)]
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=str(tmp),
                                      start_new_session=True))  # its own process group: killed with its ranks
        outs.append(out)
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=max(1.0, t0 + timeout - time.time()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    seconds = time.time() - t0
    log = []
    for node, out in enumerate(outs):
        out.seek(0)
        log.append(f"==== node {node} ====\n{out.read()}")
        out.close()
    rc = next((p.returncode for p in procs if p.returncode), 0)
    text = "\n".join(log)
    if timed_out:
        text += f"\n==== killed after {timeout:.0f} s: a rank was still running (a hang in a collective?) ===="
    return Launch(rc, text, timed_out, seconds)
