"""benchmarks/peers.py, the GPU check's peer rows (SOAP, Shampoo, PSGD-Kron against AdamW), on the CPU: every
row gets a ratio and names the package that ran; a peer whose package is absent, that raises or that is too
slow for its share of the time is a row saying so while the others run; SOAP's refresh steps are the ones
its package refreshes on, so its amortised cost counts them."""
import importlib.machinery
import math
import re
import sys
import time
import types
from importlib import metadata

import pytest
import torch
from torch import nn

from benchmarks import bench, peers

pytest.importorskip("pytorch_optimizer")


def _tiny():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.randn(32, 8), torch.randn(32, 4), nn.functional.mse_loss


bench.register_task("peers_tiny", _tiny)


class _RaisesInStep(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("cusolver error: the SVD did not converge")


class _Slow(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(0.5)
        return super().step(closure)


@pytest.fixture
def fake_package(monkeypatch):
    """An importable module `fake_peers` with an optimizer that raises in its step and one that sleeps."""
    module = types.ModuleType("fake_peers")
    module.__spec__ = importlib.machinery.ModuleSpec("fake_peers", None)
    module.RaisesInStep, module.Slow = _RaisesInStep, _Slow
    monkeypatch.setitem(sys.modules, "fake_peers", module)
    return module


def test_every_peer_gets_a_ratio_and_an_absent_or_failing_one_is_a_row_saying_so(fake_package):
    missing = peers.Peer("absent", "no-such-optimizer-package", "no_such_optimizer_package", "Absent")
    raises = peers.Peer("raises", "torch", "fake_peers", "RaisesInStep", {"lr": 0.1})
    bad = peers.Peer("bad lr", "torch", "torch.optim", "SGD", {"lr": -1.0})
    rows = {r["label"]: r for r in peers.bench_peers("peers_tiny", "cpu", 3, 0.2,
                                                     peers=[*peers.PEERS, missing, raises, bad])}
    assert list(rows) == ["adamw", "dopr_adamw", "soap f=10", "shampoo", "psgd_kron", "absent", "raises", "bad lr"]
    version = metadata.version("pytorch-optimizer")
    classes = {"soap f=10": "SOAP(precondition_frequency=10)", "shampoo": "Shampoo()", "psgd_kron": "Kron()"}
    for label, cls in classes.items():
        r = rows[label]
        assert r["status"] == "ok" and math.isfinite(r["R"]) and r["R"] > 0 and r["t"] > 0
        assert r["package"] == f"pytorch-optimizer {version}, `pytorch_optimizer.{cls}`"
    assert rows["adamw"]["R"] == 1.0 and math.isfinite(rows["dopr_adamw"]["R"])
    assert "precondition_frequency=10" in rows["soap f=10"]["defaults"]
    assert "preconditioning_compute_steps=1" in rows["shampoo"]["defaults"]   # an SVD per dimension every step
    assert rows["soap f=10"]["n"].endswith("(1 refresh)")
    assert rows["absent"]["status"] == ("missing: no-such-optimizer-package is not installed (pyproject's `peers` "
                                        "extra; `make gpu-deps` carries it to a GPU machine)")
    assert rows["raises"]["status"] == ("failed in its step 1: RuntimeError: cusolver error: the SVD did not "
                                        "converge")
    assert rows["bad lr"]["status"] == "failed when built: ValueError: Invalid learning rate: -1.0"
    table = peers.table(list(rows.values()), cuda=False).splitlines()
    assert table[0].startswith("| run | package, class |") and len(table) == 2 + len(rows)
    assert "| absent | no-such-optimizer-package: missing: no-such-optimizer-package is not installed" in table[7]


def test_kron_without_opt_einsum_is_a_missing_row_not_a_huge_allocation(monkeypatch):
    # torch.einsum contracts Kron's 5 operands left to right without opt_einsum: through a (m n)^2 tensor
    monkeypatch.setitem(sys.modules, "opt_einsum", None)   # find_spec then says: not installed
    kron = next(p for p in peers.PEERS if p.label == "psgd_kron")
    with pytest.raises(peers.PeerMissing, match=r"^opt-einsum is not installed, which Kron's einsum needs"):
        kron.check()


def test_soap_s_refresh_steps_are_the_steps_its_package_re_bases_on(monkeypatch):
    # the amortised t counts SOAP's QR re-basing (one step in precondition_frequency) at its share: the steps
    # filed as refresh steps must be exactly those in which the package ran its QR
    calls = []
    qr = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda *a, **k: calls.append(1) or qr(*a, **k))
    soap = next(p for p in peers.PEERS if p.label == "soap f=10")
    row = peers.PeerRow("peers_tiny", soap, "cpu")
    assert row.k == 10
    filed = []
    for _ in range(peers.WARMUP + 20):
        before, refreshes = len(calls), len(row.refresh)
        row.step()
        filed.append((len(calls) > before, len(row.refresh) > refreshes))
    assert filed[:peers.WARMUP] == [(False, False)] * peers.WARMUP   # untimed warm-up steps
    timed = filed[peers.WARMUP:]
    assert [qr_ran for qr_ran, _ in timed] == [as_refresh for _, as_refresh in timed]
    assert sum(qr_ran for qr_ran, _ in timed) == 2 and len(row.other) == 18


def test_a_peer_slower_than_its_share_of_the_time_stops_and_says_so(fake_package):
    slow = peers.Peer("slow", "torch", "fake_peers", "Slow", {"lr": 0.1})
    rows = {r["label"]: r for r in peers.bench_peers("peers_tiny", "cpu", 10, 5.0, peers=[slow], seconds=1.0)}
    # the rows after AdamW share what is left of 1 s once they are built (DoPr's unused part going to the
    # slow peer): under 1 s, so the slow peer stops within its two untimed 0.5 s warm-up steps (none, on a
    # machine that took the whole second to build the rows), where without the share it would time 3 steps
    assert re.match(r"out of time: [012] steps, 0 timed, in \d+\.\d s \(its share of the 1 s ran out\)$",
                    rows["slow"]["status"]), rows["slow"]["status"]
    assert rows["adamw"]["status"] == "ok" and rows["adamw"]["R"] == 1.0
