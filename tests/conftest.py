import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The Triton kernel runs on CPU tensors under the interpreter (must be set before triton is imported).
if os.environ.get("LLF_LIGER_FSDP_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The tiny local model, tokenizer and dataset (recipes/tiny_cpu/make_assets.py), built once per test process
    (about 9 s a build) and only read: runs write to their own output_dir, datasets cache outside it."""
    from support.cli import build

    return build(tmp_path_factory.mktemp("assets"))
