"""The appendix experiments' MLP: Linear-SiLU-Linear-SiLU-Linear (the grafting appendix's
(in, 256), (256, 256), (256, 10) layers)."""
from __future__ import annotations

from torch import nn


def mlp(d_in: int, width: int, d_out: int, bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, width, bias=bias), nn.SiLU(), nn.Linear(width, width, bias=bias), nn.SiLU(),
                         nn.Linear(width, d_out, bias=bias))
