"""Real 2-process sharding (gloo, CPU): FSDP1 (use_orig_params True/False, PEFT's wrap policy),
FSDP2 (fully_shard) and DDP, against the unsharded single-process unfused reference (fp32, rel <= 1e-5).

One worker job per mode runs every case (tests/fsdp_worker.py); each test checks one case. Beyond the three text
families, FSDP2 and FSDP1 (flat parameters) also run a vision-language model (Qwen2-VL, fed images), MoE families (aux
loss on) and a head with a bias (phi). The step-1 guard runs on every rank (on by default) and its all-reduced
verdict must pass for every case of a job."""

import pytest

from support.dist import assert_parity, every_rank, launch

pytestmark = pytest.mark.slow

FAMILIES = ["llama", "qwen2", "qwen2_tied"]
HEADS = ["mts", "lora", "full"]
CASES = [f"{f}:{h}" for f in FAMILIES for h in HEADS]
MODES = ["fsdp1_flat", "fsdp1_orig", "fsdp2", "ddp"]
DDP_CASES = ["llama:mts", "qwen2:lora", "qwen2_tied:full"]
FAMILY_CASES = {"fsdp2": ["qwen2_vl:mts", "qwen2_vl:lora", "qwen3_moe:mts", "mixtral:lora", "phi:mts"],
                "fsdp1_flat": ["qwen2_vl:mts", "qwen3_moe:lora", "phi:mts"]}

TOL = 1e-5


def _cases(mode):
    return DDP_CASES if mode == "ddp" else CASES + FAMILY_CASES.get(mode, [])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``get(mode)``: every rank's results of that mode's one job, and its log."""
    cache = {}

    def get(mode):
        if mode not in cache:
            out = tmp_path_factory.mktemp(mode) / "out.json"
            proc = launch("fsdp_worker.py", mode, out, *_cases(mode), timeout=900)
            cache[mode] = every_rank(proc, out), proc.stderr
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


@pytest.mark.parametrize("mode,case", [(m, c) for m in MODES if m != "ddp" for c in _cases(m)])
def test_sharded_parity(results, mode, case):
    ranks, _ = results(mode)
    for rank_results in ranks:  # every rank, not only rank 0
        _check({r["case"]: r for r in rank_results}[case], mode, case)


@pytest.mark.parametrize("mode", sorted(FAMILY_CASES))
def test_guard_exact_every_case(results, mode):
    _, log = results(mode)
    assert log.count("[liger_fsdp] guard: step 1 exact") == len(_cases(mode))  # rank 0 logs, every rank checks


@pytest.mark.parametrize("case", DDP_CASES)
def test_ddp_parity(results, case):
    ranks, _ = results("ddp")
    for rank_results in ranks:
        _check({r["case"]: r for r in rank_results}[case], "ddp", case)
