"""Helpers shared by the newer bench scripts (bench/depth_h200.py): the fields every row carries (UTC date, the card
as nvidia-smi names it, package versions), a ``{"rows": [...]}`` JSON file appended to atomically, and the real-size
model build of bench/real_size_sft.py with the depth and ``max_position_embeddings`` chosen (its build() fixes 32768).

    python bench/common.py build WORK NAME --layers 32 --max-position 131072 --rows 1400 --answer-words 300 500

builds the model in a process of its own, so the caller's process never holds a CUDA context (half a GiB that the
training runs beside it would not have).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE_ASSETS = os.path.join(ROOT, "recipes", "tiny_cpu", "make_assets.py")
DISTS = ("torch", "triton", "transformers", "peft", "accelerate", "deepspeed", "llamafactory", "liger_kernel", "trl",
         "datasets", "llamafactory_liger_fsdp")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def card() -> str:
    """The GPU as nvidia-smi names it, with its memory and driver ("cpu" without one) -- read without torch, so the
    caller never opens a CUDA context."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    return line or "cpu"


def load_rows(path: str) -> list:
    """The rows of a ``{"rows": [...]}`` file (a bare list is read too); [] when there is none."""
    if not os.path.exists(path):
        return []
    data = json.load(open(path))
    return data["rows"] if isinstance(data, dict) else data


def save_rows(path: str, rows: list) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)


def append_row(path: str, row: dict) -> None:
    save_rows(path, load_rows(path) + [row])


def build_model(work: str, name: str, spec: dict, layers: int, *, max_position: int, rows: int,
                answer_words: tuple[int, int]) -> str:
    """bench/real_size_sft.build with the depth and max_position_embeddings given: tokenizer + data from
    recipes/tiny_cpu/make_assets.py, the model from its config with random weights on the GPU, bf16, untied head,
    saved once under WORK/NAME/model (kept: a later call on the same machine reuses it)."""
    mdir = os.path.join(work, name)
    if os.path.exists(os.path.join(mdir, "model", "config.json")):
        return mdir
    subprocess.run([sys.executable, MAKE_ASSETS, mdir, "--no-model", "--rows", str(rows), "--answer-words",
                    *map(str, answer_words)], check=True)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(mdir, "model"))
    kw = {k: v for k, v in spec.items() if k not in ("model_type", "layer")}
    config = AutoConfig.for_model(spec["model_type"], num_hidden_layers=layers, max_position_embeddings=max_position,
                                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = os.path.join(mdir, "model_tmp")  # config.json lands in model/ last: a stopped build is not taken as done
    model.save_pretrained(tmp)
    for fname in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, fname), os.path.join(mdir, "model", fname))
    os.rmdir(tmp)
    return mdir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build"])
    ap.add_argument("work")
    ap.add_argument("name")
    ap.add_argument("--spec", default="llama3-8b", help="a key of bench/real_size_sft.MODELS")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-position", type=int, default=131072)
    ap.add_argument("--rows", type=int, default=1400)
    ap.add_argument("--answer-words", type=int, nargs=2, default=(300, 500))
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from real_size_sft import MODELS

    print(build_model(args.work, args.name, MODELS[args.spec], args.layers, max_position=args.max_position,
                      rows=args.rows, answer_words=tuple(args.answer_words)))


if __name__ == "__main__":
    main()
