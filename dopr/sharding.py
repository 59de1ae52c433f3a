"""Parameter sharding (FSDP2): the AP acts on each rank's shard of the weight's rows.

The AP multiplies the gradient on the right, M = [G | g_b] (Sigma + lambda I)^-1, so each row of M needs only
the same row of G and the global Sigma (dopr/distributed.py). FSDP2 (``fully_shard``) shards every parameter on
dim 0, a weight and its bias at the same rows: no gradient is gathered. Whole-matrix GPs (Muon, AdaMuon) gather
each matrix once (:func:`on_whole_matrix`). FSDP1's ``FlatParameter`` and DeepSpeed ZeRO-3 do not keep a
weight's rows together: :func:`check_supported` refuses them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

try:  # torch built without distributed support has no DTensor
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = Replicate = Shard = None


def is_sharded(t: Optional[Tensor]) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Optional[Tensor]) -> Optional[Tensor]:
    """This rank's shard of a DTensor (a view: writing to it writes the DTensor), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def check_supported(model: nn.Module) -> None:
    """Raise for sharding schemes whose shards are not row blocks of each weight."""
    for name, p in model.named_parameters():
        if type(p).__name__ == "FlatParameter":
            raise ValueError(
                f"DoPr does not support FSDP1 (parameter {name!r} is a FlatParameter, which flattens many "
                "weights into one buffer): shard with FSDP2 (torch.distributed.fsdp.fully_shard), whose "
                "row shards DoPr preconditions shard by shard, or use DistributedDataParallel")
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            raise ValueError(
                f"DoPr does not support DeepSpeed ZeRO-3 (parameter {name!r} is partitioned by DeepSpeed): shard "
                "with FSDP2 (torch.distributed.fsdp.fully_shard), or use ZeRO stage 0-2 / DistributedDataParallel")
        if is_sharded(p):
            bad = [pl for pl in p.placements if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0))]
            if bad:
                raise ValueError(f"DoPr supports parameters sharded on dim 0 (FSDP2) or replicated; {name!r} has "
                                 f"placements {p.placements}")


def row_range(t: Tensor) -> tuple:
    """(first, stop) of the global rows this rank holds of a dim-0-sharded DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], offset[0] + shape[0]


def on_whole_matrix(fn, t: Tensor, like: Tensor) -> Tensor:
    """``fn`` (a whole-matrix map: Newton-Schulz) of the matrix whose rows this rank holds as ``t`` (sharded as
    ``like``), back to this rank's rows: one all-gather, ``fn`` on every rank. Not sharded: ``fn(t)``."""
    full = fn(t.full_tensor() if is_sharded(t) else t)
    if not is_sharded(like):
        return full
    first, stop = row_range(like)
    return full[first:stop]


def norm(local_t: Tensor, like: Tensor) -> Tensor:
    """The Frobenius norm of the whole matrix whose rows ``local_t`` are (sharded like ``like``), a float64 scalar:
    summed in float64 so that it does not depend on the split over ranks (AdaMuon's RMS alignment passes a float32
    sum's ~n * 6e-8 on to every entry)."""
    rows = torch.linalg.vector_norm(local_t.reshape(local_t.shape[0], -1), dim=1, dtype=torch.float64).square()
    if not is_sharded(like):
        return rows.sum().sqrt()
    whole = DTensor.from_local(rows, like.device_mesh, like.placements, run_check=False,
                               shape=torch.Size((like.shape[0],)), stride=(1,))
    return whole.sum().full_tensor().sqrt()


def gather_matrix(g: Tensor, like: Tensor, axis: int, per_row: int) -> Tensor:
    """The whole matrix of which ``g`` is this rank's part, split along ``axis`` as ``like``'s rows
    are, ``per_row`` lines of ``g`` per row of ``like`` (one all-gather)."""
    other = g.shape[1 - axis]
    return _from_weight_rows(gather_rows(_to_weight_rows(g, axis, per_row), like), other, axis)


def local_matrix(g: Tensor, like: Tensor, axis: int, per_row: int) -> Tensor:
    """This rank's part of the whole matrix ``g`` (the inverse of :func:`gather_matrix`)."""
    first, stop = row_range(like)
    return _from_weight_rows(_to_weight_rows(g, axis, per_row)[first:stop], g.shape[1 - axis], axis)


def _to_weight_rows(g: Tensor, axis: int, per_row: int) -> Tensor:
    """A matrix as (weight rows, rest): the layout FSDP2 shards."""
    return g.movedim(axis, 0).reshape(-1, per_row * g.shape[1 - axis])


def _from_weight_rows(rows: Tensor, other: int, axis: int) -> Tensor:
    return rows.reshape(-1, other).movedim(0, axis).contiguous()


def gather_rows(local_rows_t: Tensor, like: Tensor) -> Tensor:
    """The whole (rows, cols) matrix whose rows this rank holds as ``local_rows_t``, split over the
    ranks as ``like``'s rows are (one all-gather)."""
    cols = local_rows_t.shape[1]
    whole = DTensor.from_local(local_rows_t.contiguous(), like.device_mesh, like.placements, run_check=False,
                               shape=torch.Size((like.shape[0], cols)), stride=(cols, 1))
    return whole.full_tensor()
