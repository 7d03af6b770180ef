"""What the Triton loss needs to know about the labels on the host, read in one host sync.

Before its first GEMM the loss needs: whether a label lies outside ``[0, V)`` (a ``ValueError``), how many rows are
labelled (buffer sizes, the path), which they are, and for the target term of the gradient the labels sorted with
their distinct values (sizes again) and, per vocabulary slab, where those values start. Each size read separately is
a host sync, and at the start of a call the GPU idles through all of them (H200, 16k x 4096 x 128k:
``bench/results/archive/h200_start_cost.json``). :func:`scan_labels` computes them all on the device and reads the sizes with
one ``tolist()``; everything after that is shaped by ``nonzero_static`` and never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SortedLabels:
    """The valid rows sorted by label (stable): ``perm`` their positions among the valid rows, ``src_rows`` their rows
    in the input, ``labels`` the distinct labels (increasing) and ``starts`` [n_labels + 1] where each begins."""

    perm: torch.Tensor
    src_rows: torch.Tensor
    labels: torch.Tensor
    starts: torch.Tensor


@dataclass
class LabelScan:
    """``idx`` the labelled rows (increasing), ``y_valid`` their labels; ``sorted`` when asked for; ``bounds`` the
    number of distinct labels below each slab edge ``0, slab, 2 slab, ...`` (edges up to ``V + slab``) when a slab
    width was given."""

    idx: torch.Tensor
    n_valid: int
    all_valid: bool
    y_valid: torch.Tensor
    sorted: SortedLabels | None = None
    bounds: list[int] | None = None


def out_of_range(labels: torch.Tensor, v: int, valid: torch.Tensor) -> torch.Tensor:
    """The labelled rows (``valid``) whose label lies outside ``[0, V)``."""
    return valid & ((labels < 0) | (labels >= v))


def label_error(labels: torch.Tensor, v: int, ignore_index: int, bad: torch.Tensor) -> ValueError:
    """The one error for labels outside ``[0, V)`` that are not ``ignore_index`` (``bad`` marks them)."""
    first = int(labels[bad.nonzero()[0, 0]])
    return ValueError(
        f"fused_linear_cross_entropy: label {first} is outside [0, V) with V={v} (the head weight's rows) and is "
        f"not ignore_index={ignore_index} ({int(bad.sum())} such label(s)). Was the vocabulary resized after "
        "adding tokens?"
    )


def scan_labels(labels: torch.Tensor, v: int, ignore_index: int, *, want_sorted: bool,
                slab: int | None = None) -> LabelScan:
    """The labels' facts (see :class:`LabelScan`) with one host sync; raises :func:`label_error` for a bad label."""
    valid = labels != ignore_index
    bad = out_of_range(labels, v, valid)
    facts = [bad.sum(), valid.sum()]
    if want_sorted:
        keys, order = torch.sort(torch.where(valid, labels, v), stable=True)  # the ignored rows last
        first = torch.ones_like(valid)
        first[1:] = keys[1:] != keys[:-1]
        first &= keys < v
        facts.append(first.sum())
        if slab:
            edges = torch.arange(0, v + slab, slab, device=labels.device, dtype=keys.dtype)
            below = torch.searchsorted(keys, edges)  # keys below each edge
            distinct = torch.zeros(keys.numel() + 1, device=labels.device, dtype=torch.int64)
            torch.cumsum(first, 0, out=distinct[1:])  # distinct labels among the first k keys
            facts.append(distinct.index_select(0, below))
    host = torch.cat([f.reshape(-1).long() for f in facts]).tolist()  # the one sync
    if host[0]:
        raise label_error(labels, v, ignore_index, bad)
    n_valid = host[1]
    all_valid = n_valid == labels.shape[0]
    idx = torch.arange(n_valid, device=labels.device) if all_valid else (
        torch.nonzero_static(valid, size=n_valid).squeeze(1))
    scan = LabelScan(idx, n_valid, all_valid, labels if all_valid else labels.index_select(0, idx))
    if want_sorted:
        n_labels = host[2]
        src_rows = order[:n_valid]
        perm = src_rows if all_valid else (torch.cumsum(valid, 0) - 1).index_select(0, src_rows)
        heads = torch.nonzero_static(first, size=n_labels).squeeze(1)
        starts = torch.cat([heads, torch.full((1,), n_valid, device=labels.device, dtype=heads.dtype)])
        scan.sorted = SortedLabels(perm, src_rows, keys.index_select(0, heads), starts)
        if slab:
            scan.bounds = host[3:]
    return scan
