"""TEST-ONLY stand-ins that let LLaMA-Factory v1's Ulysses sequence parallelism (``cp_size > 1``) run on CPU gloo
ranks. :func:`install` (called by ``cpu_ulysses_shim/sitecustomize.py``, which tests and benchmarks put on
``PYTHONPATH``) replaces, in every process of the run:

* flash-attention's kernels, as transformers' lazy import returns them for ``flash_attention_2``
  (``flash_attn_func`` / ``flash_attn_varlen_func``), by plain scaled-dot-product attention (per segment for varlen);
* the ``flash_attention_2`` availability checks (installed package, GPU device), so v1 may load the model with it;
* ``torch.distributed.all_to_all`` (list form, which gloo lacks) on gloo groups by ``all_to_all_single``, and the
  backward of ``torch.distributed.nn.all_gather`` on gloo (torch emulates its reduce-scatter by scatters from global
  ranks ``0..n-1``, which fails in a subgroup without rank 0: data parallel x CP) by that all-to-all and a sum;
* ``dist.get_rank()`` inside v1's ``sequence_parallel`` module (its loss moves the inputs to that CUDA index) by
  the CPU device -- or, with ``CPU_ULYSSES_STRICT_DEVICES=1`` in a process whose global rank is not its local rank
  (a second torchrun "node"), by an error: a real node has no device of that index;
* transformers' ``flash_attention_forward`` calling ``s_aux.to()`` on None (transformers 5.6; 5.8 checks).

Nothing here changes what the loss or the attention computes; the Ulysses all-to-all, its padding and splitting are
LLaMA-Factory's own. The package never imports this module.
"""

from __future__ import annotations

import sys

from .. import _import_hook

FLASH = "flash_attention_2"
SP_MODULE = "llamafactory.v1.plugins.model_plugins.parallelization.sequence_parallel"


# --------------------------------------------------------------------------- attention
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False):
    """flash-attention's ``[B, S, H, D]`` call as scaled-dot-product attention (grouped KV heads included)."""
    import torch.nn.functional as F

    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("cpu_ulysses: sliding windows and softcaps are not stood in for")
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError("cpu_ulysses: causal attention with different query and key lengths")
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                                         is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """flash-attention's packed ``[total, H, D]`` call: one attention per segment of ``cu_seqlens``."""
    import torch

    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("cpu_ulysses: different query and key segments")
    out = q.new_zeros(q.shape[:2] + v.shape[2:])
    cuts = [int(c) for c in cu_seqlens_q]
    for s, e in zip(cuts[:-1], cuts[1:]):
        out[s:e] = flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], dropout_p, softmax_scale, causal,
                                   window_size, softcap)[0]
    return out


def _patch_flash_utils(mod) -> None:
    original = mod._lazy_imports

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation == FLASH:
            return flash_attn_func, flash_attn_varlen_func, None, mod._pad_input, mod._unpad_input
        return original(implementation, *args, **kwargs)

    mod._lazy_imports = _lazy_imports
    matrix = getattr(mod, "FLASH_ATTENTION_COMPATIBILITY_MATRIX", {})
    if 2 in matrix:  # "installed": no fallback to a hub kernel
        matrix[2]["general_availability_check"] = lambda *a, **k: True


class _NoSink:
    """What ``s_aux.to(dtype)`` gives when there is no attention sink: None."""

    def to(self, *args, **kwargs):
        return None


def _patch_modeling_utils(mod) -> None:
    cls = mod.PreTrainedModel
    can = cls._flash_attn_can_dispatch

    def _flash_attn_can_dispatch(self, flash_attn_version, is_init_check=False):
        return True if flash_attn_version == 2 else can(self, flash_attn_version, is_init_check)

    cls._flash_attn_can_dispatch = _flash_attn_can_dispatch
    interface = mod.AttentionInterface
    forward = interface._global_mapping.get(FLASH)
    if forward is not None:
        def flash_attention_forward(module, query, key, value, attention_mask, *args, s_aux=None, **kwargs):
            return forward(module, query, key, value, attention_mask, *args,
                           s_aux=_NoSink() if s_aux is None else s_aux, **kwargs)

        interface.register(FLASH, flash_attention_forward)


# --------------------------------------------------------------------------- collectives
def _patch_all_to_all() -> None:
    import torch
    import torch.distributed as dist

    original = dist.all_to_all

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        if dist.get_backend(group) != "gloo":
            return original(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
        sizes_in = [t.numel() for t in input_tensor_list]
        sizes_out = [t.numel() for t in output_tensor_list]
        flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
        flat_out = flat_in.new_empty(sum(sizes_out))
        dist.all_to_all_single(flat_out, flat_in, sizes_out, sizes_in, group=group)
        for t, piece in zip(output_tensor_list, flat_out.split(sizes_out)):
            t.copy_(piece.view_as(t))
        return None

    dist.all_to_all = all_to_all

    from torch.distributed.nn import functional as autograd_fn

    gather_backward = autograd_fn._AllGather.backward

    def backward(ctx, *grad_outputs):  # gloo: torch's AlltoAll stand-in scatters from global ranks 0..n-1
        if dist.get_backend(group=ctx.group) != "gloo":
            return gather_backward(ctx, *grad_outputs)
        received = [torch.empty_like(g) for g in grad_outputs]
        all_to_all(received, [g.contiguous() for g in grad_outputs], group=ctx.group)
        return None, torch.stack(received).sum(0)

    autograd_fn._AllGather.backward = staticmethod(backward)


STRICT = "CPU_ULYSSES_STRICT_DEVICES"


class _CpuRankDist:
    """``torch.distributed`` for v1's sequence_parallel module, except that ``get_rank()`` (which it uses only as the
    device to move inputs to) is the CPU; under :data:`STRICT` it raises where the global rank is not the local rank
    (the CUDA index would name another node's device, or none)."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    def get_rank(self, group=None):
        import torch
        import torch.distributed as dist

        if group is not None:
            return dist.get_rank(group)
        import os

        rank, local = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
        if os.environ.get(STRICT) == "1" and rank != local:
            raise RuntimeError(f"cpu_ulysses ({STRICT}): {SP_MODULE} addresses device cuda:{rank} by the global "
                               f"rank; this process is local rank {local} of its node, which has no such device "
                               "(CUDA error: invalid device ordinal)")
        return torch.device("cpu")


def _patch_sequence_parallel(mod) -> None:
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (the loss's autograd all_gather)

    mod.dist = _CpuRankDist()
    split = mod.padding_and_split_data

    def padding_and_split_data(data, device_mesh=None):
        ids, labels = data.get("input_ids"), data.get("labels")
        out = split(data, device_mesh)
        if device_mesh is not None and ids is not None and ids.ndim == 2:  # what the tests assert: this rank's shard
            cp, t = device_mesh["cp"], out["input_ids"].shape[-1]
            cut = [r * t for r in range(1, cp.size()) if r * t < ids.shape[-1]]
            across = int((labels[:, cut] != -100).sum()) if labels is not None and cut else 0
            sys.stderr.write(f"[cpu_ulysses] rank {cp.get_local_rank()} of cp {cp.size()}: input_ids "
                             f"{list(ids.shape)} -> {list(out['input_ids'].shape)}, labelled targets across shard "
                             f"boundaries: {across} (global rank {dist.get_rank()})\n")  # one write: ranks share a file
            sys.stderr.flush()
        return out

    mod.padding_and_split_data = padding_and_split_data


# --------------------------------------------------------------------------- install
PATCHERS = {
    "transformers.modeling_flash_attention_utils": _patch_flash_utils,
    "transformers.modeling_utils": _patch_modeling_utils,
    SP_MODULE: _patch_sequence_parallel,
}


def install() -> None:
    """Apply every stand-in in this process (modules not imported yet: when they are)."""
    if _import_hook.installed("cpu_ulysses"):
        return
    _patch_all_to_all()
    _import_hook.after_import("cpu_ulysses", PATCHERS, lambda module: PATCHERS[module.__name__](module))
