"""How long the test tiers take on this machine (the README's "fast tier" figure): runs them through the README's test
command and appends one JSON row per tier to --out (a list; the CI rows of fresh clones are added there by hand).

    python scripts/cpu_test_times.py [--full] [--out bench/results/cpu_test_times.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = {"fast": ["-m", "not slow"], "full": []}


def run(tier: str) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "scripts/test.sh", "-p", "no:cacheprovider", *TIERS[tier]], cwd=ROOT,
                          capture_output=True, text=True)
    seconds = time.monotonic() - t0
    tail = (proc.stdout + proc.stderr)[-4000:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", tail)}
    return {"tier": tier, "seconds": round(seconds, 1), "rc": proc.returncode, **counts,
            "command": "bash scripts/test.sh" + (" -m 'not slow'" if tier == "fast" else ""),
            "cores": os.cpu_count(), "machine": platform.machine(),
            "date": datetime.date.today().isoformat()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="also the whole suite (what CI runs)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cpu_test_times.json"),
                    help="the rows' JSON, appended to")
    args = ap.parse_args()
    rows = [run("fast")] + ([run("full")] if args.full else [])
    old = json.load(open(args.out)) if os.path.exists(args.out) else []
    with open(args.out, "w") as f:
        json.dump(old + rows, f, indent=1)
    for r in rows:
        print(f"{r['tier']}: {r['seconds']:.0f} s, rc {r['rc']}, {r.get('passed', 0)} passed, {r.get('failed', 0)} failed")


if __name__ == "__main__":
    main()
