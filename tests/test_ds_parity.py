"""Real 2-process DeepSpeed (gloo, CPU): ZeRO-3 (with and without CPU offload), ZeRO-2, ZeRO-1 and ZeRO-0 against
the unsharded single-process unfused reference (fp32), and in bf16 under the plugin's dtype policy. One worker job
runs every case but Liger-Kernel's (tests/ds_worker.py)."""

import pytest

from support.dist import assert_parity, every_rank, launch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

CASES = ["llama:mts:3", "llama:lora:3", "llama:full:3", "qwen2_tied:full:3", "qwen2:mts:3:both",
         "llama:mts:2", "llama:lora:2", "qwen2_tied:full:2", "llama:mts:1", "qwen2:lora:0",
         "llama:lora:3:empty"]  # step 2 without a labelled token on any rank: the parameters after it still agree
BF16 = ["llama:mts:3:bf16", "llama:lora:3:bf16", "llama:full:3:bf16", "qwen2_tied:full:3:bf16", "llama:mts:2:bf16"]
TOL = 1e-5


def _worker(tmp_path_factory, name, cases):
    """Every rank's results of one tests/ds_worker.py job (2 gloo ranks)."""
    out = tmp_path_factory.mktemp(name) / "out.json"
    return every_rank(launch("ds_worker.py", out, *cases, timeout=1200, env={"CUDA_VISIBLE_DEVICES": ""}), out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The fp32 cases and the bf16 ones in one job (a launch is ~20 s of imports and process-group start-up)."""
    return _worker(tmp_path_factory, "ds", CASES + BF16)


@pytest.mark.parametrize("case", CASES)
def test_zero_parity(ranks, case):
    stage = int(case.split(":")[2])
    for rank_results in ranks:  # every rank
        result = {r["case"]: r for r in rank_results}[case]
        assert_parity(result, TOL)
        if case.endswith(":empty"):
            assert result["empty_step_grads"] == {"finite": True, "zero": True}, result["empty_step_grads"]
        proof = result["proof"]
        if stage == 3:  # partitioned: an empty placeholder outside the forward, gathered by DeepSpeed's hooks
            assert all(n == 0 for n in proof["head_numel_outside_forward"].values()), proof
            assert all(s == "NOT_AVAILABLE" for s in proof["ds_status"].values()), proof
            assert proof["units"] == len(proof["ds_status"]), proof
            assert "through DeepSpeed's gather hooks of" in result["engaged"], result["engaged"]
            # gathered only while the loss runs: released when the embedding runs and when backward reaches it
            seen = result["head_while_embedding"]
            if "tied" not in case:
                assert len(seen["embed_forward"]) >= 3, seen  # every step (the step-1 guard adds forwards)
                assert len(seen["embed_backward"]) >= (0 if ":lora:" in case else 3), seen  # trained embedding
                assert all(s == ["NOT_AVAILABLE"] for s in seen["embed_forward"] + seen["embed_backward"]), seen
        else:  # ZeRO-0/1/2 partition optimizer state and gradients, never the weights
            assert proof["head_numel_outside_forward"] == proof["head_full_numel"] and proof["units"] == 0, proof
            assert "on the whole (unpartitioned) head weight" in result["engaged"], result["engaged"]


@pytest.mark.parametrize("case", BF16)
def test_bf16_kernel_gets_the_compute_dtype(ranks, case):
    """DeepSpeed bf16 (ZeRO-3 with PEFT's fp32 LoRA weights beside bf16 copies, and ZeRO-2): the fused kernel receives
    bf16 hidden states and head weights for every head kind, on every rank (no fp32 island, no [V, H] fp32 copy), and
    the run equals the unfused model under the same dtype policy within bf16 rounding."""
    for rank_results in ranks:
        result = {r["case"]: r for r in rank_results}[case]
        assert "error" not in result, result["error"]
        assert result["kernel_dtypes"] == ["bfloat16/bfloat16"], result["kernel_dtypes"]
        assert result["loss_rel"] <= 5e-3, result["loss_rel"]
        assert max(result["grad_rels"].values()) <= 5e-2, result["grad_rels"]
        assert result["moved"] > 1e-3


LIGER = ["llama:mts:3:liger", "llama:lora:3:liger"]


@pytest.fixture(scope="module")
def liger_ranks(tmp_path_factory):
    pytest.importorskip("liger_kernel")
    return {r["case"]: r for r in _worker(tmp_path_factory, "ds_liger", LIGER)[0]}


def test_liger_under_zero3_what_users_get_without_the_plugin(liger_ranks):
    """Liger-Kernel's own fused loss under ZeRO-3 (its class forward, as LLaMA-Factory applies it): with a trained
    modules_to_save head it is exact, but reading the weight inside the model's forward registers it with the whole
    model, so from step 2 on it stays gathered while the embedding runs, forward and backward; with LoRA on the head
    it silently uses the base weight: the loss is off and the head's LoRA weights get no gradient."""
    mts, lora = liger_ranks["llama:mts:3:liger"], liger_ranks["llama:lora:3:liger"]
    assert "error" not in mts and "error" not in lora, (mts.get("error"), lora.get("error"))
    assert mts["loss_rel"] <= TOL and max(mts["grad_rels"].values()) <= TOL
    seen = mts["head_while_embedding"]
    assert seen["embed_forward"][0] == ["NOT_AVAILABLE"] and all("AVAILABLE" in s for s in seen["embed_forward"][1:])
    assert all("AVAILABLE" in s for s in seen["embed_backward"])
    assert lora["loss_rel"] > 1e-3, lora["loss_rel"]
    head = {n: r for n, r in lora["grad_rels"].items() if "lm_head.lora_" in n}
    assert head and all(r == 1.0 for r in head.values()), head  # zero gradient: never trained
