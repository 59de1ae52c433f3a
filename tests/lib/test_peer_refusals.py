"""What a peer GP (dopr/gp/peers.py: SOAP, Shampoo, PSGD-Kron) cannot take is refused in one line naming the layer,
the package or the extra: Shampoo's large dimension, Kron's einsum without opt_einsum, a peer without its package."""
import importlib.util
import sys

import pytest
import torch
from torch import nn

import dopr
from dopr.gp import peers

pytest.importorskip("pytorch_optimizer")


def test_shampoo_refuses_a_large_dimension_naming_the_layer():
    model = nn.Sequential(nn.Embedding(peers.SHAMPOO_MAX_DIM + 1, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"^GP 'shampoo': parameter '0.weight' of shape \(10001, 4\) would get a "
                                         r"10001 x 10001 factor") as e:
        dopr.build(model, "shampoo", ap={}, lr=1e-3)
    assert "\n" not in str(e.value) and "use soap or kron" in str(e.value)
    dopr.build(model, "soap", lr=1e-3)   # SOAP leaves that dimension to Adam, Kron gives it a diagonal factor
    dopr.build(model, "kron", lr=1e-3)


def test_kron_is_refused_where_torch_would_contract_its_einsum_through_the_outer_product(monkeypatch):
    model = nn.Linear(4, 2)
    monkeypatch.setattr(torch.backends.opt_einsum, "enabled", False)
    with pytest.raises(RuntimeError, match=r"^GP 'kron': pytorch_optimizer.Kron applies its factors by a 5-operand "
                                           r"torch.einsum, which without opt_einsum") as e:
        dopr.build(model, "kron", lr=1e-3)
    assert "\n" not in str(e.value) and "pip install 'dopr[peers]'" in str(e.value)
    monkeypatch.setattr(torch.backends.opt_einsum, "enabled", True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "opt_einsum" else real(n, *a))
    with pytest.raises(RuntimeError, match="^GP 'kron': "):
        dopr.build(model, "kron", ap={}, lr=1e-3)


def test_a_peer_without_its_package_fails_in_one_line_naming_package_and_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    with pytest.raises(ImportError) as e:
        dopr.build(nn.Linear(4, 2), "soap", ap={}, lr=1e-3)
    assert str(e.value) == ("GP 'soap' is pytorch_optimizer.SOAP from the pytorch-optimizer package, which is not "
                            "installed: pip install 'dopr[peers]'")
