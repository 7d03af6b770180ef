"""The first-step guard on 2 gloo ranks under FSDP2 (tests/guard_worker.py): exact under accelerate's bf16 mixed
precision (its fp32 head mode leaves FSDP2's own casts of the shards alone), checked on step 1 when only one rank has
labels, a data error on one rank stops every rank, and a failure of the model's own forward on one rank leaves that
rank with its own error while the launcher stops the other -- within seconds, no mismatched collective."""

import pytest

from support.dist import every_rank, launch

pytestmark = pytest.mark.slow


def _worker(out, *cases):
    return launch("guard_worker.py", out, *cases, timeout=300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard") / "out.json"
    proc = _worker(out, "mixed", "labels_on_one_rank", "bad_ids_on_one_rank")
    return [{r["case"]: r for r in rank} for rank in every_rank(proc, out)]


def test_bf16_mixed_precision_exact(ranks):
    for rank in ranks:
        assert "worker_error" not in rank["mixed"] and rank["mixed"]["finite_grads"], rank["mixed"]
    line = ranks[0]["mixed"]["guard_lines"]
    assert len(line) == 1 and "guard: step 1 exact" in line[0] and "from the same bfloat16 inputs" in line[0], line


def test_labels_on_one_rank_is_checked_on_step_1(ranks):
    assert ranks[0]["labels_on_one_rank"]["guard_lines"] == [
        "[liger_fsdp] guard: step 1 not checked on this rank: no labelled position in its slice."]
    assert all(rank["labels_on_one_rank"]["finite_grads"] for rank in ranks)


def test_data_error_on_one_rank_stops_every_rank(ranks):
    for i, rank in enumerate(ranks):
        result = rank["bad_ids_on_one_rank"]
        assert result["error_type"] == "LigerFsdpDataError" and "`resize_vocab`" in result["error"], result
    assert "token id 10000 in input_ids" in ranks[1]["bad_ids_on_one_rank"]["error"]
    assert "rank 1's batch" in ranks[0]["bad_ids_on_one_rank"]["error"]


def test_failure_on_one_rank_propagates_without_a_hang(tmp_path):
    proc = _worker(tmp_path / "out.json", "fails_on_one_rank")
    assert proc.returncode != 0
    assert "rank 1: RuntimeError: CUDA out of memory (planted on rank 1)" in proc.stderr
    assert "raised inside the first-step guard (step 1)" in proc.stderr
    assert "EnforceNotMet" not in proc.stderr and "collective mismatch" not in proc.stderr, proc.stderr[-3000:]
