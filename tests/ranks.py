"""A test's gloo processes: starting them (rank0_result), and ending one as experiments.common.distributed.shutdown does."""
import gc

import torch.distributed as dist


def leave_process_group() -> None:
    """Call after deleting the rank's DDP/FSDP model and optimizer: a DistributedDataParallel still
    alive when the group is destroyed aborts its process now and then (SIGABRT, "terminate called
    without an active exception": 2 of 50 two-rank runs here, 0 of 50 with it deleted first)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def rank0_result(worker, world: int = 2):
    """Run ``worker(rank, world, init_file, out)`` on `world` gloo processes; what rank 0 saved to ``out``."""
    import os
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), out), nprocs=world, join=True)
        return torch.load(out)
