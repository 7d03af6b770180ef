"""Real 2-process sharding (gloo, CPU): FSDP1 (use_orig_params True/False, PEFT's wrap policy),
FSDP2 (fully_shard) and DDP, against the unsharded single-process unfused reference (fp32).

One worker job per mode runs every case (tests/fsdp_worker.py); each test checks one case."""

import pytest

from support.dist import assert_parity, every_rank, launch

pytestmark = pytest.mark.slow

FAMILIES = ["llama", "qwen2", "qwen2_tied"]
HEADS = ["mts", "lora", "full"]
CASES = [f"{f}:{h}" for f in FAMILIES for h in HEADS]
MODES = ["fsdp1_flat", "fsdp1_orig", "fsdp2", "ddp"]
DDP_CASES = ["llama:mts", "qwen2:lora", "qwen2_tied:full"]

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(mode):
        if mode not in cache:
            out = tmp_path_factory.mktemp(mode) / "out.json"
            cases = DDP_CASES if mode == "ddp" else CASES
            cache[mode] = every_rank(launch("fsdp_worker.py", mode, out, *cases, timeout=900), out)
        return cache[mode]

    return get


def _check(result, mode, case):
    assert_parity(result, TOL)
    proof = result["proof"]
    tied_full = case == "qwen2_tied:full"
    if mode.startswith("fsdp1"):
        assert proof["fsdp"] == "FSDP1"
        assert proof["local_numel"] * 2 <= proof["full_numel"] + 2, f"the head is not sharded: {proof}"
        assert proof["head_units"] == (0 if tied_full else 1), proof
    elif mode == "fsdp2":
        assert proof["fsdp"] == "FSDP2" and proof["dtensor"], proof
        assert proof["local_rows"] * 2 == proof["full_rows"], f"the head is not sharded: {proof}"
        assert proof["head_units"] == (0 if tied_full else 1), proof
    else:
        assert proof["ddp"] == "DistributedDataParallel"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["fsdp1_flat", "fsdp1_orig", "fsdp2"])
def test_sharded_parity(results, mode, case):
    ranks = results(mode)
    for rank_results in ranks:  # every rank, not only rank 0
        _check({r["case"]: r for r in rank_results}[case], mode, case)


@pytest.mark.parametrize("case", DDP_CASES)
def test_ddp_parity(results, case):
    ranks = results("ddp")
    for rank_results in ranks:
        _check({r["case"]: r for r in rank_results}[case], "ddp", case)
