"""Data parallel: 2 gloo processes with half the batch each give the 1-process whole-batch update."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dopr import DoPr
from ranks import leave_process_group

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 5, generator=g).double(), torch.randn(40, 3, generator=g).double()


def _train(model, opt, x, y, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_model())
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=1e-3)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)  # count DoPr's collectives
    x, y = _data()
    half = slice(rank * 20, (rank + 1) * 20)
    _train(model, opt, x[half], y[half])
    dist.all_reduce = real
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.module.parameters()], "calls": len(calls)}, out)
    del model, opt
    leave_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_with_half_batches_match_one_process_with_the_whole_batch():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2, join=True)
        result = torch.load(out)
    # per step: the layout agreement (2 floats per layer) and one packed all-reduce of the statistics,
    # not one per layer
    assert result["calls"] == 2 * 3
    model = _model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=1e-3)
    x, y = _data()
    _train(model, opt, x, y)
    for p, q in zip(model.parameters(), result["params"]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)
