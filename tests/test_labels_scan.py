"""``ops.labels.scan_labels``: the labels' facts the Triton loss needs, from one host sync, equal to building them one
size at a time (``nonzero``, a stable sort, ``unique_consecutive``, ``searchsorted``), on messy labels."""

import pytest
import torch

from llamafactory_liger_fsdp.ops.labels import scan_labels


def _one_at_a_time(labels, v, ignore_index, slab):
    idx = (labels != ignore_index).nonzero().squeeze(1)
    y = labels.index_select(0, idx)
    ys, perm = torch.sort(y, stable=True)
    uniq, counts = torch.unique_consecutive(ys, return_counts=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    bounds = torch.searchsorted(uniq, torch.arange(0, v + slab, slab)).tolist()
    return idx, y, perm, idx.index_select(0, perm), uniq, starts, bounds


@pytest.mark.parametrize("case", ["mixed", "all_valid", "none_valid", "one_label", "empty", "other_ignore"])
def test_one_sync_equals_one_size_at_a_time(case):
    g = torch.Generator().manual_seed(7)
    v, ignore = 50, -100
    labels = torch.randint(0, v, (97,), generator=g)
    if case == "mixed":
        labels[torch.rand(97, generator=g) < 0.4] = ignore
        labels[:5] = torch.tensor([49, 0, ignore, 0, 49])  # both ends of the vocabulary, repeated
    elif case == "none_valid":
        labels[:] = ignore
    elif case == "one_label":
        labels[:] = 3
        labels[::4] = ignore
    elif case == "empty":
        labels = labels[:0]
    elif case == "other_ignore":
        ignore = 7
        labels[::3] = 7
    for slab in (1, 8, 64):
        scan = scan_labels(labels, v, ignore, want_sorted=True, slab=slab)
        idx, y, perm, src, uniq, starts, bounds = _one_at_a_time(labels, v, ignore, slab)
        assert scan.n_valid == idx.numel() and scan.all_valid == (idx.numel() == labels.numel())
        for got, want in ((scan.idx, idx), (scan.y_valid, y), (scan.sorted.perm, perm),
                          (scan.sorted.src_rows, src), (scan.sorted.labels, uniq), (scan.sorted.starts, starts)):
            assert torch.equal(got.long(), want.long()), (case, got, want)
        assert scan.bounds == bounds
    plain = scan_labels(labels, v, ignore, want_sorted=False)
    assert plain.sorted is None and plain.bounds is None and torch.equal(plain.idx, idx)


@pytest.mark.parametrize("bad", [50, -1, -101, 10**9])
def test_bad_label_named_from_the_same_sync(bad):
    labels = torch.tensor([1, bad, -100, 2, bad])
    with pytest.raises(ValueError, match=f"label {bad} is outside .* V=50 .*2 such label"):
        scan_labels(labels, 50, -100, want_sorted=True, slab=8)
