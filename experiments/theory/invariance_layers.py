"""Convolutional and attention affine invariance (the appendix corollaries "Convolutional Affine
invariance" and "Attention projection AP invariance"), measured as the feedforward case is.

Two copies of one network see x and the transformed input, the second's first layer absorbing the
inverse transform, so both start as the same function on corresponding batches:

* ``conv``: a Conv2d net on images whose pixels are mixed by x -> Q x + d (Q invertible, on the C_in
  channels of every pixel). Under im2col every patch vector becomes A z + (d per patch entry) with
  A = Q (x) I_(k*k): an invertible affine map of the patch features, the corollary's
  Zbar = A_l Z_l with the shift in homogeneous coordinates. The first convolution has no padding (a
  padded border would see 0, not d) and takes (W A^-1, b - W A^-1 d).
* ``attention``: a self-attention block whose token features feed the q, k and v projections through
  x -> Q x + d per token; each projection takes (W Q^-1, b - W Q^-1 d), the corollary's
  Wbar^r = W^r A^-1 for r in {Q, K, V}.

Under DoPr-SGD at damping 0 the two validation-loss trajectories agree to rounding (the bound is
:func:`rounding_bound`); under SGD they drift apart. The library's guard for a numerically singular
Sigma at damping 0 (a relative cutoff, eigh_rcond) is not invariant: the map can push the transformed
Sigma's condition number past 1 / eigh_rcond (see ARMS). ``conv2d="sua"`` is also invariant to the
channel map Q (its channel covariance becomes Q Sigma_c Q^T) but not to the shift (its bias is not
in the covariance), so it is measured with d = 0.

    python -m experiments.theory.invariance_layers --out results/invariance/layers.md
"""
from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from dopr import DoPr
from dopr.gp import SGD

EPS = torch.finfo(torch.float64).eps
#: the cases of the table: (network, DoPr options, whether x is shifted as well as mixed)
CASES = {"conv": ({"conv2d": "full"}, True), "conv_sua": ({"conv2d": "sua"}, False),
         "attention": ({}, True)}
STEPS = 40
#: the arms: (rate, DoPr's options, or None for plain SGD). SGD's rate keeps its run on x_t stable (Q's spectrum
#: reaches 100). "dopr_sgd" is the exact AP of the corollaries: damping 0, and a numerically singular Sigma (a
#: Cholesky pivot^2 under eigh_rcond x its largest diagonal entry, dopr/solvers.py) only where it is singular to
#: rounding (1e-12), not where the map makes it ill-conditioned: A Sigma A^T's condition number reaches
#: cond(A)^2 cond(Sigma). "dopr_sgd_rcond_1e-6" is damping 0 with the library's default guard, "dopr_sgd_damped"
#: the default damping 1e-4 tr(Sigma): the invariance covers neither.
ARMS = {"dopr_sgd": (0.05, {"damping": 0.0, "eigh_rcond": 1e-12}), "dopr_sgd_rcond_1e-6": (0.05, {"damping": 0.0}),
        "dopr_sgd_damped": (0.05, {"damping": 1e-4}), "sgd": (1e-4, None)}


def input_map(dim: int, gen: torch.Generator, shift: bool) -> tuple:
    """(Q, d): Q symmetric with eigenvalues linspace(1, 100) (condition number 100), d a random
    shift (zero unless ``shift``)."""
    u = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))[0]
    q = u @ torch.diag(torch.linspace(1, 100, dim, dtype=torch.float64)) @ u.T
    d = torch.randn(dim, generator=gen, dtype=torch.float64) if shift else torch.zeros(dim, dtype=torch.float64)
    return q, d


class AttentionBlock(nn.Module):
    """Multi-head self-attention from nn.Linear q, k, v, out projections (what DoPr preconditions),
    followed by a token-wise MLP and the mean over tokens."""

    def __init__(self, width: int, heads: int, d_out: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, d_out))

    @property
    def first_layers(self) -> list:
        return [self.q, self.k, self.v]

    def forward(self, x):
        b, t, w = x.shape
        split = lambda h: h.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(w // self.heads), dim=-1)
        h = self.out((att @ v).transpose(1, 2).reshape(b, t, w))
        return self.mlp(h).mean(1)


class ConvNet(nn.Module):
    """Conv2d(C, 8, 3) -> SiLU -> Conv2d(8, 8, 3, padding 1) -> SiLU -> 2x2 average pool -> Linear: the
    first convolution unpadded (see the module docstring)."""

    def __init__(self, channels: int, d_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 2 * 2, d_out)

    @property
    def first_layers(self) -> list:
        return [self.conv1]

    def forward(self, x):
        h = nn.functional.silu(self.conv2(nn.functional.silu(self.conv1(x))))
        return self.head(nn.functional.adaptive_avg_pool2d(h, 2).flatten(1))


def _network(case: str, dim: int) -> nn.Module:
    return (ConvNet(dim, 3) if case.startswith("conv") else AttentionBlock(dim, 2, 3)).double()


def _inputs(case: str, gen: torch.Generator, n: int) -> tuple:
    """(x, its feature axis): images (n, 4, 8, 8) with channel covariance eigenvalues logspace(0, 2)
    and correlated neighbours, or token sets (n, 6, 8) likewise."""
    dim = 4 if case.startswith("conv") else 8
    o = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))[0]
    mix = o @ torch.diag(torch.logspace(0, 1, dim, dtype=torch.float64)) @ o.T   # covariance eigenvalues 1..100
    if case.startswith("conv"):
        x = torch.randn(n, 8, 9, dim, generator=gen, dtype=torch.float64) @ mix
        return (x[:, :, 1:] + x[:, :, :-1]).permute(0, 3, 1, 2), 1   # neighbouring pixels correlated
    return torch.randn(n, 6, dim, generator=gen, dtype=torch.float64) @ mix, -1


def network_pair(case: str, seed: int = 0, n: int = 640) -> tuple:
    """(net on x, net on x_t, x, x_t, y): the two copies start as the same function (the second's
    first layers are (W A^-1, b - W A^-1 d)); y is a teacher of the same architecture on x."""
    gen = torch.Generator().manual_seed(seed)
    x, axis = _inputs(case, gen, n)
    dim = x.shape[axis]
    q, d = input_map(dim, gen, shift=CASES[case][1])
    xt = torch.movedim(torch.movedim(x, axis, -1) @ q.T + d, -1, axis)
    torch.manual_seed(seed)
    net, twin, teacher = _network(case, dim), _network(case, dim), _network(case, dim)
    with torch.no_grad():
        y = teacher(x)
    twin.load_state_dict(net.state_dict())
    qinv = torch.linalg.inv(q)
    with torch.no_grad():
        for layer in twin.first_layers:
            # W A^-1: Q^-1 on the weight's input-channel axis (dim 1), at every kernel offset of a conv
            w = torch.movedim(torch.movedim(layer.weight, 1, -1) @ qinv, -1, 1)
            layer.weight.copy_(w)
            layer.bias.sub_((torch.movedim(w, 1, -1) @ d).reshape(w.shape[0], -1).sum(1))
    return net, twin, x, xt, y


def trajectories(case: str, optimizer: str, steps: int = STEPS, seed: int = 0, **options) -> tuple:
    """Validation losses (one per step) of the pair on x and on x_t, cycling through minibatches of
    128, for one of ARMS; DoPr with the case's options (``options`` over them)."""
    net, twin, x, xt, y = network_pair(case, seed)
    n_train = x.shape[0] - 128
    curves = []
    for model, inputs in ((net, x), (twin, xt)):
        lr, arm = ARMS[optimizer]
        base = SGD(model.parameters(), lr=lr, momentum=0.0)
        opt = base if arm is None else DoPr(model, base, **{**arm, **CASES[case][0], **options})
        losses = []
        for step in range(steps):
            batch = slice((step * 128) % n_train, (step * 128) % n_train + 128)
            loss = ((model(inputs[batch]) - y[batch]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                losses.append(((model(inputs[n_train:]) - y[n_train:]) ** 2).mean().item())
        curves.append(torch.tensor(losses, dtype=torch.float64))
    return tuple(curves)


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest gap between two loss trajectories, relative to the largest loss."""
    return ((a - b).abs().max() / a.abs().max()).item()


def rounding_bound(case: str, steps: int = STEPS, seed: int = 0) -> float:
    """What float64 rounding alone may put between the two DoPr trajectories: per step, the solve with
    the transformed first layer's Sigma (its activation vectors with the homogeneous 1) has a relative
    forward error up to d * eps * cond(Sigma) (Cholesky's backward error d * eps, times the condition
    number), and the errors of ``steps`` steps add up (first order)."""
    _, twin, _, xt, _ = network_pair(case, seed)
    layer = twin.first_layers[0]
    inputs = []
    hook = layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    with torch.no_grad():
        twin(xt)
    hook.remove()
    z, sua = inputs[0], CASES[case][0].get("conv2d") == "sua"
    if isinstance(layer, nn.Conv2d):   # the activation vectors: im2col patches, or SUA's pixels
        z = z.permute(0, 2, 3, 1) if sua else nn.functional.unfold(z, layer.kernel_size).transpose(1, 2)
    z = z.reshape(-1, z.shape[-1])
    if not sua:   # the homogeneous 1 of a layer with a bias
        z = torch.cat([z, torch.ones(z.shape[0], 1, dtype=z.dtype)], 1)
    sigma = z.T @ z / z.shape[0]
    return steps * sigma.shape[0] * EPS * torch.linalg.cond(sigma).item()


def table(seeds=(0, 1, 2), steps: int = STEPS) -> list:
    rows = []
    for case in CASES:
        for seed in seeds:
            bound = rounding_bound(case, steps, seed)
            for optimizer, (lr, arm) in ARMS.items():
                a, b = trajectories(case, optimizer, steps, seed)
                rows.append({"case": case, "seed": seed, "optimizer": optimizer, "lr": lr,
                             "damping": "" if arm is None else arm["damping"], "steps": steps,
                             "final_val_x": a[-1].item(), "final_val_transformed": b[-1].item(),
                             "max_relative_gap": relative_gap(a, b), "rounding_bound": bound})
    return rows


def main(argv=None) -> None:
    from experiments.common.provenance import emit_report, git_revision, markdown_table, portable_command

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the table there (markdown)")
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = table(tuple(int(s) for s in args.seeds.split(",")))
    command = portable_command("python -m experiments.theory.invariance_layers " + " ".join(argv or []))
    lines = ["# Convolutional and attention affine invariance: validation loss on x vs on the transformed input", "",
             f"`{command}`, commit {git_revision()}, torch {torch.__version__}, float64; DoPr's damping is "
             "damping_mode trace (lambda = damping x tr(Sigma)); dopr_sgd takes eigh_rcond 1e-12, the others the "
             "default 1e-6 (ARMS in the module). "
             "max_relative_gap: the largest |loss(x) - loss(x_t)| over the steps over the largest loss; "
             "rounding_bound: steps x d x eps x cond(Sigma) of the transformed first layer "
             "(experiments/theory/invariance_layers.py, rounding_bound).", ""]
    lines += markdown_table(rows, 3)
    for case in CASES:
        gaps = {o: [r["max_relative_gap"] for r in rows if r["case"] == case and r["optimizer"] == o] for o in ARMS}
        lines.append("")
        lines.append(f"- {case}: over {len(gaps['sgd'])} seeds, the largest gap of DoPr-SGD at damping 0 "
                     f"{max(gaps['dopr_sgd']):.2g} (rounding bound at least "
                     f"{min(r['rounding_bound'] for r in rows if r['case'] == case):.2g}), with the default "
                     f"eigh_rcond {max(gaps['dopr_sgd_rcond_1e-6']):.2g}, at damping 1e-4 "
                     f"{min(gaps['dopr_sgd_damped']):.2g} to {max(gaps['dopr_sgd_damped']):.2g}; SGD's "
                     f"{min(gaps['sgd']):.2g} to {max(gaps['sgd']):.2g}")
    emit_report(lines, args.out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
