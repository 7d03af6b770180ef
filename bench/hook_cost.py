"""What the ``.pth`` import hook adds to every Python start in the environment: ``python -c pass``, median of
``--runs`` interleaved starts, in a bare venv against the same bare venv with the plugin installed the way
``pip install -e .`` installs it (its ``.pth`` hook plus the path entry), so nothing else differs. Also the
README's venv (``.venv``, other packages' ``.pth`` files included) for reference, and ``-X importtime``'s
cumulative microseconds for the plugin's modules. Prints a table and writes one JSON row.

    python bench/hook_cost.py [--runs 30] [--out bench/results/hook_cost.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _venv(path: str, with_plugin: bool) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if with_plugin:
        with open(os.path.join(site, "_editable_llamafactory_liger_fsdp.pth"), "w") as f:
            f.write(ROOT + "\n")
        with open(os.path.join(ROOT, "llamafactory_liger_fsdp.pth")) as src, \
                open(os.path.join(site, "llamafactory_liger_fsdp.pth"), "w") as dst:
            dst.write(src.read())
    return python


#: As a user's shell has it: bytecode caches written and used (this workplace sets PYTHONDONTWRITEBYTECODE=1, which
#: makes every start compile the plugin's modules again).
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}


def _start_ms(python: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True, env=ENV)
    return (time.perf_counter() - t0) * 1e3


def _importtime_us(python: str) -> int:
    err = subprocess.run([python, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, env=ENV).stderr
    total = 0
    for line in err.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2].strip() in ("llamafactory_liger_fsdp._bootstrap", "llamafactory_liger_fsdp"):
            total += int(parts[1])  # cumulative: the package, then _bootstrap with what it imports
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "hook_cost.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pythons = {"bare venv": _venv(os.path.join(tmp, "bare"), False),
                   "bare venv + plugin": _venv(os.path.join(tmp, "plugin"), True)}
        readme = os.path.join(ROOT, ".venv", "bin", "python")
        if os.path.exists(readme):
            pythons["README venv (.venv)"] = readme
        for python in pythons.values():  # warm the page cache and write .pyc files
            for _ in range(3):
                _start_ms(python)
        times = {name: [] for name in pythons}
        for _ in range(args.runs):
            for name, python in pythons.items():
                times[name].append(_start_ms(python))
        importtime = {name: _importtime_us(python) for name, python in pythons.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    added = medians["bare venv + plugin"] - medians["bare venv"]
    print(f"{'python -c pass':24s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s} {'plugin import us':>17s}")
    for name, t in times.items():
        print(f"{name:24s} {medians[name]:10.2f} {min(t):8.2f} {max(t):8.2f} {importtime[name]:17d}")
    print(f"added by the plugin's hook: {added:+.2f} ms (median of {args.runs})")
    row = {"what": "python -c pass", "runs": args.runs, "median_ms": medians,
           "min_ms": {k: min(v) for k, v in times.items()}, "max_ms": {k: max(v) for k, v in times.items()},
           "plugin_importtime_us": importtime, "added_ms": round(added, 3),
           "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "date": datetime.date.today().isoformat()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": [row]}, f, indent=1)


if __name__ == "__main__":
    main()
