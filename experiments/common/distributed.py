"""Data parallel plumbing shared by the families: rank and world size, sums over ranks, the
DistributedDataParallel wrapper, no_sync for gradient accumulation, and a DataLoader that gives each
rank its share of a dataset with worker processes. A single process is world size 1 throughout."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world() -> tuple:
    """(rank, world size)."""
    if initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return world()[0] == 0


def all_reduce_sum(x, device):
    """The sum over ranks of a number (a float back) or a numpy array (a float64 array back), summed in
    float64 on ``device``; in one process x itself (a number as a float)."""
    if world()[1] == 1:
        return float(x) if isinstance(x, (int, float)) else x
    t = torch.as_tensor(x, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.cpu().numpy() if t.ndim else float(t.item())


def shutdown(failed: bool = False) -> None:
    """End of a distributed job: the process group destroyed once the job's models are gone. A
    DistributedDataParallel still alive when the group is destroyed can abort its process at exit
    (gloo: SIGABRT in about 1 of 25 two-rank runs measured here), which marks a finished SLURM job
    failed. The barrier (skipped after a failure, where a peer may never arrive) keeps one rank from
    tearing down while another still communicates."""
    if not initialized():
        return
    import gc

    gc.collect()
    if not failed:
        dist.barrier()
    dist.destroy_process_group()


def wrap_ddp(model: nn.Module, device) -> nn.Module:
    """DistributedDataParallel under torch.distributed; the model itself otherwise."""
    if not initialized():
        return model
    ids = [torch.cuda.current_device()] if torch.device(device).type == "cuda" else None
    # not static_graph=True: with reentrant checkpointing it breaks no_sync (tests/suite/test_llm.py)
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def gradient_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch's backward: no all-reduce before the last micro-batch of an
    accumulation window (DDP's no_sync; FSDP2's set_requires_gradient_sync)."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def data_loader(dataset, batch_size: int, seed: int, shuffle: bool = True, workers: int = 0,
                drop_last: bool = True, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """Each rank's batches of `dataset` (a DistributedSampler splits it; call `set_epoch(e)` on
    `loader.sampler` every epoch), loaded by `workers` processes."""
    rank, size = world()
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed,
                                                  drop_last=drop_last)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                                       drop_last=drop_last, pin_memory=pin_memory,
                                       persistent_workers=workers > 0)
