"""Data parallel: every rank must apply the same preconditioner.

Gradients are already averaged by DistributedDataParallel; the activation statistics are not.
Summing each layer's sums and sample counts over ranks gives the statistics of the global batch,
Sigma = (sum_r S_r) / (sum_r n_r). All layers travel in one flat float32 buffer: one all-reduce per
step, not one per layer. Every rank must have run the same preconditioned layers (as DDP requires).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_statistics(stats: list) -> None:
    """Sum ActivationStatistics (in place: their sums and counts are replaced) over all ranks."""
    if not stats or not is_distributed():
        return
    flat = torch.cat(
        [s.flatten() for st in stats for s in st.sums]
        + [torch.tensor([float(st.count) for st in stats], dtype=stats[0].sums[0].dtype, device=stats[0].sums[0].device)]
    )
    dist.all_reduce(flat)
    offset = 0
    for st in stats:
        sums = []
        for s in st.sums:
            sums.append(flat[offset:offset + s.numel()].view_as(s).to(s.dtype))
            offset += s.numel()
        st.sums = tuple(sums)
    for i, st in enumerate(stats):
        st.count = float(flat[offset + i])


def all_reduce_flags(t) -> None:
    """Sum a small tensor over ranks in place (non-finite checks under sharding: any rank's NaN counts)."""
    if is_distributed():
        dist.all_reduce(t)
