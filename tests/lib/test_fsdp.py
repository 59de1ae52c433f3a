"""Parameter sharding (FSDP2): 2 gloo processes, each holding its rows of every weight and half the
batch, give the 1-process whole-batch update, for DoPr over every GP. Uneven row splits (7 rows over
2 ranks: 4 + 3; 3 rows: 2 + 1; an 11-token embedding: 6 + 5) and biases sharded with their rows."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dopr
from dopr import DoPr
from ranks import leave_process_group

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)

NAMES = ("dopr_sgd", "dopr_adamw", "dopr_signum", "dopr_muon", "dopr_adamuon", "muon", "dopr_adamw_ema")
KWARGS = {"dopr_sgd": dict(lr=0.1, momentum=0.9), "dopr_adamw": dict(lr=1e-2), "dopr_signum": dict(lr=1e-2),
          "dopr_muon": dict(lr=2e-2), "dopr_adamuon": dict(lr=2e-2), "muon": dict(lr=2e-2),
          "dopr_adamw_ema": dict(lr=1e-2, ap=dict(grad_ema=0.9))}  # gradient EMA buffers: sharded state


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (40,), generator=g), torch.randn(40, 3, generator=g).double()


def _optimizer(model, name):
    gp, wrapped = dopr.split_name(name.removesuffix("_ema"))
    kw = dict(KWARGS[name])
    return dopr.build(model, gp, ap={"damping": 1e-3, **kw.pop("ap", {})} if wrapped else None, weight_decay=0.01, **kw)


def _train(model, opt, x, y, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _weak(estimate="spectrum"):
    """A Linear(3, 4) whose third input carries 1e-6 of the variance but drives two targets (the rows rank 1
    holds, so that a rank alone would choose otherwise): at damping
    1e-6 tr(Sigma) most of M lies in that direction, so weak_share_bound raises the damping (the spectrum
    rule or its Cholesky filter)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 3, generator=g).double() * torch.tensor([1.0, 1.0, 1e-3]).double()
    y = torch.stack([x[:, 0], x[:, 1], x[:, 0] - x[:, 1] + 1e3 * x[:, 2], 1e3 * x[:, 2]], 1)   # rank 1's rows only
    model = nn.Sequential(nn.Linear(3, 4)).double()
    opt = lambda m: dopr.build(m, "adamw", lr=1e-2, ap={"damping": 1e-6, "health_every": 1, "weak_share_bound": 0.5,
                                                      "weak_share_estimate": estimate})
    return model, opt, x, y


def _worker(rank, world, init_file, out):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    x, y = _data()
    half = slice(rank * 20, (rank + 1) * 20)
    result = {}
    for name in NAMES:
        model = _model()
        for i in (0, 1, 3):
            fully_shard(model[i])
        fully_shard(model)
        opt = _optimizer(model, name)
        _train(model, opt, x[half], y[half])
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
        result[name] = {"params": params, "local_rows": [p.to_local().shape[0] for p in model.parameters()],
                        "preconditioned": opt.stats()["preconditioned"] if isinstance(opt, DoPr) else None}
        if isinstance(opt, DoPr):  # the AP state as whole tensors (all ranks gather), and back to rows
            ap = opt.ap_state_dict()
            fresh = _optimizer(model, name)
            fresh.load_ap_state_dict(ap)
            mine = {k: v["g"] for k, v in opt.apply.grad_ema.buffers.items()}
            result[name]["grad_ema"] = {k: v["g"] for k, v in ap["grad_ema"].items()}
            result[name]["reloaded_rows_equal"] = all(
                torch.equal(fresh.apply.grad_ema.buffers[k]["g"], g) for k, g in mine.items())
    model, build, xw, yw = _weak()          # weak_share_bound: the ranks add their energies per direction
    fully_shard(model)
    opt = build(model)
    _train(model, opt, xw[half], yw[half])
    result["weak"] = {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
                      "scale": dict(opt.refresh.damping.scale), "health": opt.stats()["health"]}
    model, build, xw, yw = _weak("filter")  # the filter: the ranks add their two energies per bisection step
    fully_shard(model)
    opt = build(model)
    _train(model, opt, xw[half], yw[half])
    result["weak_filter"] = {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
                             "stats": opt.stats()}
    if rank == 0:
        torch.save(result, out)
    model = opt = fresh = None
    leave_process_group()


@pytest.fixture(scope="module")
def sharded():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2, join=True)
        return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_two_ranks_equal_one_process_with_the_whole_batch(sharded, name):
    got = sharded[name]
    # rank 0's shards: the embedding 6 of 11 rows, Linear(6, 7) 4 of 7 (and its bias), Linear(7, 3) 2 of 3
    assert got["local_rows"] == [6, 4, 4, 4, 4, 2, 2]
    if name.startswith("dopr_"):
        assert got["preconditioned"] == 3 * 4  # every layer, every step
    model = _model()
    opt = _optimizer(model, name)
    x, y = _data()
    _train(model, opt, x, y)
    for p, q in zip(model.parameters(), got["params"]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)
    if name == "dopr_adamw_ema":  # the saved EMA buffers are the whole ones; reloading keeps each rank's rows
        whole = {k: v["g"] for k, v in opt.ap_state_dict()["grad_ema"].items()}
        assert sorted(got["grad_ema"]) == sorted(whole) == ["0", "1", "3", "5"]
        for k, g in whole.items():
            torch.testing.assert_close(got["grad_ema"][k], g, rtol=1e-10, atol=1e-12)
        assert got["reloaded_rows_equal"]


@pytest.mark.slow
def test_fsdp2_weak_share_bound_chooses_the_damping_one_process_chooses(sharded):
    """Each rank holds 2 of the 4 rows and half the batch; the damping factor comes from the energies of
    the whole gradient, so the ranks choose the one process's factor and reach its parameters."""
    model, build, x, y = _weak()
    opt = build(model)
    _train(model, opt, x, y)
    got = sharded["weak"]
    assert opt.refresh.damping.scale and all(f > 1 for f in opt.refresh.damping.scale.values())
    assert got["scale"] == opt.refresh.damping.scale
    ((key, rep),) = got["health"].items()
    assert rep["weak_share"] == opt.stats()["health"][key]["weak_share"] <= 0.5
    for p, q in zip(model.parameters(), got["params"]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_fsdp2_the_filter_chooses_the_damping_one_process_chooses(sharded):
    model, build, x, y = _weak("filter")
    opt = build(model)
    _train(model, opt, x, y)
    got = sharded["weak_filter"]
    mine = opt.stats()
    ((key, rep),) = got["stats"]["health"].items()
    assert rep["damping_scale"] == mine["health"][key]["damping_scale"] > 1
    assert got["stats"]["damping_raises"] == mine["damping_raises"] >= 1
    for p, q in zip(model.parameters(), got["params"]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)


def test_fsdp1_and_deepspeed_zero3_are_refused_with_what_to_use():
    model = nn.Sequential(nn.Linear(4, 3))
    model[0].weight.ds_id = 7  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3.*FSDP2"):
        DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _compiled_worker(rank, world, init_file, out):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _model()
    for i in (0, 1, 3):
        fully_shard(model[i])
    fully_shard(model)
    opt = _optimizer(model, "dopr_adamw")
    x, y = _data()
    half = slice(rank * 20, (rank + 1) * 20)
    _train(torch.compile(model, backend="aot_eager"), opt, x[half], y[half])
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    if rank == 0:
        torch.save({"params": params, "preconditioned": opt.stats()["preconditioned"]}, out)
    del model, opt
    leave_process_group()


@pytest.mark.slow
def test_fsdp2_with_a_compiled_forward_equals_one_eager_process():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_compiled_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2, join=True)
        got = torch.load(out)
    assert got["preconditioned"] == 3 * 4
    model = _model()
    opt = _optimizer(model, "dopr_adamw")
    x, y = _data()
    _train(model, opt, x, y)
    for p, q in zip(model.parameters(), got["params"]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)
