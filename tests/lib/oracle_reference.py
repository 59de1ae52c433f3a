"""An independent float64 reference for DoPr's M, written from docs/library.md's formulas (no import of dopr).

Per preconditioned layer the docs define, on every step,

    Gbar  = EMA_{grad_ema}(G), bias-corrected by 1 - prod beta (a new history when the layer's shape changes)
    Sigma = the mean of z z^T over every row the layer multiplied since the last step (micro-batches and
            repeated calls included), z the layer's input row with a 1 appended for a trainable bias
            (``homogeneous``); Sigmabar = EMA_{precond_ema}(Sigma), updated on the steps that gather statistics
    lam   = damping_mode's scale times damping (trace: gamma tr; trace_per_dim: gamma tr / d; absolute: gamma;
            trace_activations: gamma (tr - Sigma_hh)), or a sample-count rule's lambda with that as its floor
    M     = Gbar (Sigmabar + lam I)^-1, by the solver's formula (cholesky, newton_schulz: the exact inverse;
            eigh: the pseudo-inverse with a relative cutoff; rank1_diag, rankk_diag: the approximations of
            Sigma the docs name; span: the capped pseudo-inverse of the undamped Sigma)

and with ``precond_every = k`` Sigma is gathered and factored on every k-th step only, the last factor
applied in between. Layer layouts (G as rows x d, the rows z) are this module's own: M is equivariant under a
permutation of the coordinates, so a layout need only be consistent between z and G.

:class:`ReferenceAP` hooks a model's layers (plain forward hooks), and :meth:`ReferenceAP.step` takes the
gradients the library saw and returns each preconditioned layer's M, with the condition number and the
precision its comparison needs (layers it leaves out get their gradient raw). Everything is float64. Also
written out: the sample count N_eff (rows over Kish's design effect) and the rules built on it, and
``weak_share_bound``'s factor (the spectrum's hard share on a health report, held in between, or the
filter's soft share on every refresh), each with the choices a rounding-borderline share allows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

F64 = torch.float64
#: the sample-count rule's one constant (docs: "KAPPA = 4 ... chosen once")
KAPPA = 4.0
#: Hugging Face's GPT-2 Conv1D, matched by name (this module does not import transformers)
HF_CONV1D = "transformers.pytorch_utils.Conv1D"


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of the statistics dtype (float32 for half precision)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2


def statistics_eps(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


@dataclass
class Options:
    """The options the reference reads, with DoPr's defaults (docs/library.md's table)."""

    damping: float = 1e-4
    damping_mode: str = "trace"
    damping_rule: str = "trace"
    solver: str = "cholesky"
    grad_ema: float = 0.0
    precond_ema: float = 0.0
    precond_every: int = 1
    homogeneous: bool = True
    conv2d: str = "full"
    rank: int = 8
    eigh_rcond: float = 1e-6
    span_rcond: float = 1e-6
    span_cap: float = 100.0
    warmup_steps: int = 0
    health_every: int = 0
    weak_share_bound: Optional[float] = None
    weak_share_estimate: str = "spectrum"

    @classmethod
    def of(cls, options: dict) -> "Options":
        known = {k: v for k, v in options.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# ------------------------------------------------------------------------------------------- the layers
@dataclass
class Layer:
    """One preconditioned module: its kind, whether it carries the homogeneous 1, its captured inputs."""

    name: str
    module: nn.Module
    kind: str                      # linear, hf_conv1d, conv, conv_sua, conv_transpose1d, embedding
    homogeneous: bool
    inputs: list = field(default_factory=list)
    sources: list = field(default_factory=list)     # the tensors it read, kept alive until the step (their
                                                    # ids then name them: layers reading one share Sigma)

    @property
    def share_key(self) -> Optional[tuple]:
        """Linear-like layers (nn.Linear, Conv1D) reading one tensor share one Sigma (docs: q/k/v)."""
        return ("linear", self.homogeneous) if self.kind in ("linear", "hf_conv1d") else None

    @property
    def params(self) -> list:
        ps = [self.module.weight]
        if self.homogeneous:
            ps.append(self.module.bias)
        return ps


def _classes(module) -> set:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}


def layer_kind(module: nn.Module, options: Options) -> Optional[str]:
    """The docs' list of preconditioned layer types (None: the module's parameters go to the GP raw)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter) or not w.requires_grad:
        return None                # frozen weight (only its bias, if any, trains: raw)
    if HF_CONV1D in _classes(module):
        return "hf_conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.ConvTranspose1d):
        return "conv_transpose1d" if module.groups == 1 else None
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.groups != 1:
            return None
        return "conv_sua" if isinstance(module, nn.Conv2d) and options.conv2d == "sua" else "conv"
    if isinstance(module, nn.Embedding):
        return None if module.sparse else "embedding"
    return None


def find_layers(model: nn.Module, options: Options) -> list:
    out = []
    for name, module in model.named_modules():     # a module held under two names: its first
        kind = layer_kind(module, options)
        if kind is None:
            continue
        bias = getattr(module, "bias", None)
        homogeneous = (options.homogeneous and kind not in ("embedding", "conv_sua") and isinstance(bias, Tensor)
                       and bias.requires_grad)
        out.append(Layer(name, module, kind, homogeneous))
    return out


# --------------------------------------------------------------------------------- rows and gradients
def _conv_padding(m) -> list:
    """F.pad's list (last spatial dim first) for a convolution's padding ('same', 'valid' or numbers)."""
    pads = []
    for i in reversed(range(len(m.kernel_size))):
        if isinstance(m.padding, str):
            total = m.dilation[i] * (m.kernel_size[i] - 1) if m.padding == "same" else 0
            pads += [total // 2, total - total // 2]
        else:
            pads += [m.padding[i], m.padding[i]]
    return pads


def conv_rows(m, x: Tensor) -> Tensor:
    """Patches of a Conv1d / Conv2d input as rows (channel, kernel offset), by F.unfold."""
    spatial = len(m.kernel_size)
    if x.dim() == spatial + 1:
        x = x.unsqueeze(0)
    assert m.padding_mode == "zeros", "the oracle's models use zero padding"
    x = F.pad(x, _conv_padding(m))
    if spatial == 1:
        cols = F.unfold(x.unsqueeze(2), (1, m.kernel_size[0]), dilation=(1, m.dilation[0]), stride=(1, m.stride[0]))
    else:
        cols = F.unfold(x, m.kernel_size, dilation=m.dilation, stride=m.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def conv_transpose1d_rows(m, x: Tensor) -> Tensor:
    """y[o, t] = sum_{i, j} W[i, o, j] x[i, s] over t = s stride - padding + j dilation: the row of output
    position t holds x[i, s] at (i, j) where such an s exists, else 0 (the weight's layout is (i, o, j))."""
    if x.dim() == 2:
        x = x.unsqueeze(0)
    (k,), (s,), (p,), (dl,), (op,) = m.kernel_size, m.stride, m.padding, m.dilation, m.output_padding
    n, c, length = x.shape
    out_len = (length - 1) * s - 2 * p + dl * (k - 1) + op + 1
    z = x.new_zeros(n, out_len, c, k)
    src = torch.arange(length)
    for j in range(k):
        t = src * s - p + j * dl
        ok = (t >= 0) & (t < out_len)
        z[:, t[ok], :, j] = x[:, :, src[ok]].transpose(1, 2)
    return z.reshape(n * out_len, c * k)


def rows_of(layer: Layer, x: Tensor) -> Tensor:
    """The activation rows (n x d_in, float64) of one captured input (not for embeddings)."""
    x = x.to(F64)
    m = layer.module
    if layer.kind in ("linear", "hf_conv1d"):
        return x.reshape(-1, x.shape[-1])
    if layer.kind == "conv":
        return conv_rows(m, x)
    if layer.kind == "conv_sua":
        x = x if x.dim() == 4 else x.unsqueeze(0)
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
    if layer.kind == "conv_transpose1d":
        return conv_transpose1d_rows(m, x)
    raise ValueError(layer.kind)


def grad_matrix(layer: Layer, grads: dict) -> Optional[Tensor]:
    """G (rows x d, float64) from `grads` {parameter: gradient} in this module's layout; None without one."""
    m = layer.module
    g = grads.get(m.weight)
    if g is None:
        return None
    g = g.to(F64)
    if layer.kind == "linear":
        w = g
    elif layer.kind == "hf_conv1d":
        w = g.T
    elif layer.kind == "conv":
        w = g.reshape(g.shape[0], -1)
    elif layer.kind == "conv_sua":
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
    elif layer.kind == "conv_transpose1d":
        w = g.permute(1, 0, 2).reshape(g.shape[1], -1)
    elif layer.kind == "embedding":
        return g.T
    else:
        raise ValueError(layer.kind)
    if not layer.homogeneous:
        return w
    gb = grads.get(m.bias)
    gb = torch.zeros(w.shape[0], dtype=F64) if gb is None else gb.to(F64).reshape(-1)
    return torch.cat([w, gb[:, None]], 1)


# ---------------------------------------------------------------------------- the sample count (N_eff)
def _design_effect(x: Tensor, t: int, eps: float) -> float:
    """Kish's design effect of the mean (docs: T tr Cov(m) / tr Cov(z) in [1, T]) of rows x (N, T, d): m the
    per-sample means; rows with no spread beyond rounding (rows eps E||z||^2) count once per sample."""
    n = x.shape[0]
    rows = n * t
    means = x.mean(1)
    mu = means.mean(0)
    second = x.square().sum() / rows
    spread = second - mu.square().sum()                                   # tr Cov(z)
    share = (means - mu).square().sum(-1).mean() / spread if spread > rows * eps * second else torch.tensor(1.0)
    return float(min(max(t * float(share), 1.0), float(t)))


#: the precision of a measured design effect: the capture computes it as a float32 tensor
#: (dopr.sample_count.design_effect's docstring: "a 0-d float32 tensor"), so a sample-count lambda built on
#: one is float32-accurate even in a float64 model
DESIGN_EFFECT_U = torch.finfo(torch.float32).eps / 2


def independent_rows(layer: Layer, x: Tensor, rows: int) -> float:
    """N_eff of one forward (docs, 'The count'): a 2-D input's rows each; token rows (N, T..., d) over their
    design effect; a convolution's patches over the design effect of its input's pixels; an unbatched
    convolution input's rows as they are."""
    eps = statistics_eps(x.dtype) if x.dtype in (torch.float32, torch.float64) else statistics_eps(torch.float32)
    x = x.detach().to(F64)
    if layer.kind in ("conv", "conv_sua", "conv_transpose1d"):
        spatial = 1 if layer.kind == "conv_transpose1d" else len(layer.module.kernel_size)
        if x.dim() == spatial + 1:
            return float(rows)
        n = x.shape[0]
        if rows <= n or rows % n:
            return float(rows)
        t = rows // n
        if layer.kind == "conv_transpose1d":
            z = rows_of(layer, x).reshape(n, t, -1)
            return rows / _design_effect(z, t, eps)
        pixels = x.reshape(n, x.shape[1], -1).transpose(1, 2)            # (N, pixels, C): the pixels as rows
        return rows / min(max(t * _design_effect(pixels, pixels.shape[1], eps) / pixels.shape[1], 1.0), float(t))
    if x.dim() < 3:
        return float(rows)
    n = x.shape[0]
    if rows <= n or rows % n:
        return float(rows)
    return rows / _design_effect(x.reshape(n, rows // n, x.shape[-1]), rows // n, eps)


def ema_count_factor(beta: float, t: int) -> float:
    """N_eff of a bias-corrected EMA of t batches over one batch's (docs: (1 + b)(1 - b^t) / ((1 - b)(1 + b^t)))."""
    if beta <= 0.0 or t <= 1:
        return 1.0
    return (1.0 + beta) * (1.0 - beta ** t) / ((1.0 - beta) * (1.0 + beta ** t))


def sample_count_lambda(trace: float, d: int, n_eff: float, eps: float, seen: bool) -> float:
    """docs: lambda = tr/d * max(1/KAPPA - (1 - sqrt(min(q, 1)))^2, d eps), q = d / N_eff; "seen": times q at q > 1."""
    n_eff = max(n_eff, 1.0)
    q = d / n_eff
    share = max(1.0 / KAPPA - (1.0 - math.sqrt(min(q, 1.0))) ** 2, d * eps)
    lam = trace / d * share
    return lam * max(q, 1.0) if seen else lam


def trace_lambda(gamma: float, mode: str, diag: Tensor, homogeneous: bool) -> float:
    tr = float(diag.sum())
    if mode == "trace":
        return gamma * tr
    if mode == "trace_per_dim":
        return gamma * tr / diag.shape[0]
    if mode == "absolute":
        return gamma
    if mode == "trace_activations":
        return gamma * (tr - float(diag[-1])) if homogeneous else gamma * tr
    raise ValueError(mode)


# ------------------------------------------------------------------------------------------ operators
@dataclass
class Operator:
    """M = G P (P the float64 (pseudo-)inverse the docs define), with what the comparison's bound needs:
    ``cond`` the condition number of the operator (of Sigma + lam I for an exact inverse, the ratio of the
    largest to the smallest amplification for a pseudo-inverse), ``u`` the unit roundoff of the precision it
    was formed in, ``rows`` and ``d`` the sizes, ``ambiguous`` directions (an eigenvalue within rounding of a
    solver's cutoff: the library may keep or drop them) and ``extra`` any further sensitivity factor."""

    p: Tensor
    cond: float
    u: float
    rows: int
    d: int
    lam: float
    ambiguous: Optional[Tensor] = None       # (d, a) orthonormal directions, their largest amplification,
    ambiguous_gain: float = 0.0              # and the angle rounding may turn them by
    ambiguous_turn: float = 0.0
    extra: float = 1.0
    what: str = ""
    lam_u: float = 0.0                       # the relative precision of lam's inputs, where coarser than u


    def apply(self, g: Tensor) -> Tensor:
        return g @ self.p


def _ambiguous(e: Tensor, v: Tensor, cutoff: float, tol: float, gains: Tensor) -> tuple:
    """(directions, their largest amplification, how far rounding may turn them) of the eigenvalues within
    ``tol`` of a solver's ``cutoff``: the library, whose Sigma and eigendecomposition carry rounding, may keep
    or drop them, and its eigenvectors there are turned by up to tol / gap (Davis-Kahan) towards the others."""
    near = (e - cutoff).abs() <= tol
    if not bool(near.any()):
        return None, 0.0, 0.0
    far = e[~near]
    gap = float((e[near][:, None] - far[None, :]).abs().min()) if far.numel() else math.inf
    return v[:, near], float(gains[near].abs().max()), min(1.0, tol / gap) if gap > 0 else 1.0


def _inverse(a: Tensor) -> tuple:
    """(A^-1, cond(A)) of a symmetric A; a singular A (the formula undefined: lambda = 0 on a singular Sigma)
    gives its pseudo-inverse and cond = inf, so that only the finiteness of the library's M is checked."""
    e, v = torch.linalg.eigh(a)
    if float(e.min()) <= 0.0:
        return torch.linalg.pinv(a, hermitian=True), math.inf
    return (v / e) @ v.T, float(e.max() / e.min())


def dense_operator(sigma: Tensor, lam: float, opts: Options, u: float, rows: int, eps: float) -> Operator:
    """The solver's P for a dense Sigmabar (float64)."""
    d = sigma.shape[0]
    eye = torch.eye(d, dtype=F64)
    e, v = torch.linalg.eigh(sigma)
    top = max(float(e.max()), 0.0)
    # an eigenvalue's rounding in the precision Sigma was formed and decomposed in: a few d u ||Sigma||
    e_tol = 4 * (d + rows) * u * top
    if opts.solver in ("cholesky", "newton_schulz"):
        p, cond = _inverse(sigma + lam * eye)
        return Operator(p, cond, u, rows, d, lam, what="(Sigma + lam I)^-1")
    if opts.solver == "eigh":
        cut = opts.eigh_rcond * top
        keep = e > cut
        inv = torch.where(keep, 1.0 / (e.clamp(min=0) + lam), torch.zeros_like(e))
        amb, gain, turn = _ambiguous(e, v, cut, e_tol, 1.0 / (e.clamp(min=0) + lam))
        kept = inv[keep]
        cond = float(kept.max() / kept.min()) if kept.numel() else 1.0
        return Operator((v * inv) @ v.T, cond, u, rows, d, lam, amb, gain, turn, what="eigh pseudo-inverse")
    if opts.solver == "span":
        floor = max(opts.span_rcond, d * eps) * top
        keep = e > floor
        lowest = e.clamp(min=0).mean() / opts.span_cap if opts.span_cap < math.inf else torch.tensor(0.0, dtype=F64)
        amp = 1.0 / torch.maximum(e, lowest).clamp(min=torch.finfo(F64).tiny)
        inv = torch.where(keep, amp, torch.zeros_like(e))
        amb, gain, turn = _ambiguous(e, v, float(floor), e_tol, amp)
        kept = inv[keep]
        cond = float(kept.max() / kept.min()) if kept.numel() else 1.0
        return Operator((v * inv) @ v.T, cond, u, rows, d, 0.0, amb, gain, turn, what="span pseudo-inverse")
    if opts.solver == "rankk_diag":
        k = min(opts.rank, d)
        s, uk = e[-k:].clamp(min=0), v[:, -k:]                   # the top-k eigenpairs
        resid = sigma.diagonal() - (uk * uk * s).sum(-1)
        keep = s > 0
        a = torch.diag(resid.clamp(min=0) + lam) + (uk[:, keep] * s[keep]) @ uk[:, keep].T
        gap = float(e[-k] - e[-k - 1]) if k < d else math.inf   # U's sensitivity to Sigma's rounding
        extra = 1.0 + 2.0 * top / gap if gap > 0 else math.inf
        p, cond = _inverse(a)
        return Operator(p, cond, u, rows, d, lam, extra=extra, what=f"rankk_diag: top {k} eigenpairs + diagonal")
    raise ValueError(opts.solver)


def moments_operator(mean: Tensor, second: Tensor, lam: float, u: float, rows: int) -> Operator:
    """rank1_diag: Sigma ~ diag(E[z*z] - mu*mu) + mu mu^T (docs), damped by lam."""
    var = (second - mean * mean).clamp(min=0)
    p, cond = _inverse(torch.diag(var + lam) + torch.outer(mean, mean))
    return Operator(p, cond, u, rows, mean.shape[0], lam, what="rank1_diag: mean mean^T + diagonal")


def diagonal_operator(diag: Tensor, lam: float, u: float, rows: int) -> Operator:
    """nn.Embedding: Sigma = diag(token counts / n) exactly, whatever the solver."""
    p, cond = _inverse(torch.diag(diag + lam))
    return Operator(p, cond, u, rows, diag.shape[0], lam, what="embedding: diagonal")


# ------------------------------------------------------------------------------- the weak-share rules
#: docs: "directions carrying under 1e-4 of its input variance"
WEAK_VARIANCE = 1e-4
#: docs: "the smallest power of 2 (up to 2^20)"
MAX_DOUBLINGS = 20


def weak_shares(sigma: Tensor, g: Tensor, lam: float, soft: bool, weak_cut: float = WEAK_VARIANCE) -> Optional[list]:
    """The share of ||M||^2, M = G (Sigma + 2^j lam I)^-1, in the weak directions for j = 0..20 (docs,
    weak_share_bound): "spectrum", the directions whose eigenvalue is under 1e-4 of tr(Sigma); "filter"
    (``soft``), each direction weighted by tau^2 / (e^2 + tau^2), tau = 1e-4 tr(Sigma). None where nothing is
    weak, G is 0 or lam <= 0 (the factor is then 1)."""
    e, v = torch.linalg.eigh(sigma)
    g2 = (g @ v).square().sum(0)
    if lam <= 0 or float(g2.sum()) <= 0:
        return None
    if soft:
        tau = weak_cut * float(sigma.diagonal().sum())
        if tau <= 0:
            return None
        weight = tau ** 2 / (e.square() + tau ** 2)
    else:
        e = e.clamp(min=0)
        total = float(e.sum())
        p = e / total if total > 0 else torch.full_like(e, 1.0 / e.numel())
        weight = (p < weak_cut).to(F64)
        if not bool(weight.any()):
            return None
    out = []
    for j in range(MAX_DOUBLINGS + 1):
        energy = g2 / (e + lam * 2.0 ** j).square()
        out.append(float((energy * weight).sum() / energy.sum()))
    return out


def weak_share_choices(sigma: Tensor, g: Tensor, lam: float, bound: float, soft: bool, rel: float) -> list:
    """The factors 2^j the rule may choose: the smallest j whose share is at most ``bound`` (20 where none),
    and, where a share is within ``rel`` (relative) of the bound or a direction's variance share within ``rel``
    of the weak cut, the choices the library's rounding could make instead."""
    cuts = [WEAK_VARIANCE] if soft else [WEAK_VARIANCE * (1 - rel), WEAK_VARIANCE, WEAK_VARIANCE * (1 + rel)]
    out = set()
    for cut in cuts:
        shares = weak_shares(sigma, g, lam, soft, cut)
        if shares is None:
            out.add(1.0)
            continue
        sure = next((j for j, x in enumerate(shares) if x <= bound * (1 - rel)), MAX_DOUBLINGS)
        out |= {2.0 ** j for j, x in enumerate(shares[:sure + 1]) if x <= bound * (1 + rel) or j == sure}
    return sorted(out)


# ------------------------------------------------------------------------------------ the reference
@dataclass
class LayerResult:
    name: str
    m: Tensor                 # float64 M (rows x d) in this module's layout
    gbar: Tensor
    op: Operator
    refreshed: bool
    cancel: float = 1.0       # |EMA of |G|| / |Gbar|: the gradient EMA's cancellation
    alternatives: list = field(default_factory=list)   # [(Operator, M)]: what a rounding-borderline rule may give


class ReferenceAP:
    """The docs' algorithm, float64, beside a DoPr. Hooks `model`'s preconditioned layers (plain forward
    hooks: every forward in grad mode counts, which is what the oracle's driver runs); :meth:`step` with the
    gradients the library saw gives the expected M per layer."""

    def __init__(self, model: nn.Module, options: dict) -> None:
        self.model, self.opts = model, Options.of(options)
        self.layers = find_layers(model, self.opts)
        self.hooks = [l.module.register_forward_hook(self._hook(l)) for l in self.layers]
        self.step_count = 0        # AP steps (after warm-up)
        self.warmed = 0
        self.gbar: dict = {}       # name -> (t, buffer, decay)
        self.sbar: dict = {}       # name -> (t, tuple of buffers)
        self.cache: dict = {}      # name -> Operator of the last refresh
        self.nonfinite: list = []  # layers whose Sigma or G was not finite on the last step
        self.refreshes = 0         # refreshes so far (the health report's cadence)
        self.scale: dict = {}      # name -> the weak-share factor held since the last report ("spectrum")
        self.choices: dict = {}    # name -> [(factor, Operator)] of this step's refresh, when more than one

    def _hook(self, layer: Layer):
        def hook(module, inputs, output):
            if torch.is_grad_enabled():
                layer.inputs.append(inputs[0].detach().clone())
                layer.sources.append(inputs[0])
        return hook

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def clear(self) -> None:
        for l in self.layers:
            l.inputs, l.sources = [], []

    # ------------------------------------------------------------------ one step
    def _statistic(self, layer: Layer) -> Optional[dict]:
        """The step's statistic of `layer` from its captured inputs: Sigma (or the solver's moments, or the
        embedding's diagonal), the row count, N_eff, the precision."""
        if not layer.inputs:
            return None
        dtype = layer.module.weight.dtype
        if layer.kind == "embedding":
            v = layer.module.num_embeddings
            idx = torch.cat([x.reshape(-1) for x in layer.inputs])
            counts = torch.bincount(idx, minlength=v).to(F64)
            n = idx.numel()
            return dict(kind="diagonal", mean=(counts / n,), rows=n, n_eff=float(n), dtype=dtype)
        zs = [rows_of(layer, x) for x in layer.inputs]
        counts = [independent_rows(layer, x, z.shape[0]) for x, z in zip(layer.inputs, zs)]
        n_eff = sum(counts)
        measured = any(c != z.shape[0] for c, z in zip(counts, zs)) or any(
            x.dim() >= 3 and x.shape[0] < z.shape[0] for x, z in zip(layer.inputs, zs))
        z = torch.cat(zs)
        if layer.homogeneous:
            z = torch.cat([z, torch.ones(z.shape[0], 1, dtype=F64)], 1)
        n = z.shape[0]
        if self.opts.solver == "rank1_diag":
            return dict(kind="moments", mean=(z.mean(0), z.square().mean(0)), rows=n, n_eff=n_eff, dtype=dtype,
                        measured=measured)
        return dict(kind="dense", mean=(z.T @ z / n,), rows=n, n_eff=n_eff, dtype=dtype, measured=measured)

    def _ema_sigma(self, name: str, stat: dict) -> tuple:
        beta = self.opts.precond_ema
        if beta == 0:
            return stat["mean"], 1
        t, old = self.sbar.get(name, (0, None))
        if old is not None and [o.shape for o in old] != [m.shape for m in stat["mean"]]:
            t, old = 0, None
        t += 1
        new = tuple((beta * o if old is not None else 0) + (1 - beta) * m
                    for o, m in zip(old if old is not None else stat["mean"], stat["mean"]))
        self.sbar[name] = (t, new)
        return tuple(b / (1 - beta ** t) for b in new), t

    def _lambda(self, name: str, layer: Layer, stat: dict, mean: tuple, t: int) -> tuple:
        """(lambda, the relative precision of its inputs where coarser than the statistics dtype's: 0 else)."""
        opts = self.opts
        diag = mean[0].diagonal() if stat["kind"] == "dense" else mean[-1] if stat["kind"] == "moments" else mean[0]
        floor = trace_lambda(opts.damping, opts.damping_mode, diag, layer.homogeneous)
        if opts.damping_rule == "trace" or stat["kind"] != "dense":
            return floor, 0.0
        n_eff = stat["n_eff"] * ema_count_factor(opts.precond_ema, t)
        d = diag.shape[0]
        rule = sample_count_lambda(float(diag.sum()), d, n_eff, statistics_eps(stat["dtype"]),
                                   opts.damping_rule == "sample_count_seen")
        return max(floor, rule), (DESIGN_EFFECT_U if stat["measured"] and rule > floor else 0.0)

    def _operator(self, layer: Layer, group_g: Optional[Tensor], report: bool) -> Optional[Operator]:
        """This refresh's operator of `layer`; with weak_share_bound, the weak-share factor of its group (whose
        members' raw gradients are ``group_g``) chosen on a report ("spectrum") or every refresh ("filter"),
        the alternatives a borderline choice allows kept in ``self.choices``."""
        stat = self._statistic(layer)
        if stat is None:
            return None
        if not all(bool(m.isfinite().all()) for m in stat["mean"]):
            self.nonfinite.append(layer.name)
            return None
        mean, t = self._ema_sigma(layer.name, stat)
        lam, lam_u = self._lambda(layer.name, layer, stat, mean, t)
        u, eps = unit_roundoff(stat["dtype"]), statistics_eps(stat["dtype"])

        def make(lam_):
            if stat["kind"] == "diagonal":
                op = diagonal_operator(mean[0], lam_, u, stat["rows"])
            elif stat["kind"] == "moments":
                op = moments_operator(mean[0], mean[1], lam_, u, stat["rows"])
            else:
                op = dense_operator(mean[0], lam_, self.opts, u, stat["rows"], eps)
            op.lam_u = lam_u
            return op

        bound = self.opts.weak_share_bound
        if bound is None or stat["kind"] != "dense":
            return make(lam)
        soft = self.opts.weak_share_estimate == "filter"
        if soft or report:
            rel = 1e-3 if u > 1e-10 else 1e-7
            factors = weak_share_choices(mean[0], group_g, lam, bound, soft, rel) if group_g is not None else [1.0]
        else:
            factors = [self.scale.get(layer.name, 1.0)]
        ops = [(f, make(lam * f)) for f in factors]
        if not soft:
            self.scale[layer.name] = factors[0]
        if len(ops) > 1:
            self.choices[layer.name] = ops
        return ops[0][1]

    def chose(self, name: str, index: int) -> None:
        """The library's M matched alternative `index` of `name`'s borderline weak-share choice: it holds that
        factor (and caches that operator) from here on."""
        factor, op = self.choices[name][index]
        self.cache[name] = op
        if self.opts.weak_share_estimate != "filter":
            self.scale[name] = factor

    def groups(self, grads: dict) -> dict:
        """{layer name: the raw gradients of its statistics group, stacked}: layers reading the same tensors
        (same share key) share Sigma, and a weak-share rule reads all their gradients."""
        by_input = {}
        for l in self.layers:
            key = (l.share_key, tuple(map(id, l.sources))) if l.share_key is not None and l.sources else (l.name,)
            by_input.setdefault(key, []).append(l)
        out = {}
        for members in by_input.values():
            gs = [g for l in members if (g := grad_matrix(l, grads)) is not None]
            for l in members:
                out[l.name] = torch.cat(gs) if gs else None
        return out

    def _gbar(self, name: str, g: Tensor) -> tuple:
        """(Gbar, the same EMA of |G|): their norms' ratio is the EMA's cancellation, how much the rounding of
        its terms grows relative to Gbar."""
        beta = self.opts.grad_ema
        if beta == 0:
            return g, g.abs()
        t, old, old_abs = self.gbar.get(name, (0, None, None))
        if old is not None and old.shape != g.shape:
            t, old = 0, None
        t += 1
        new = (beta * old if old is not None else 0) + (1 - beta) * g
        new_abs = (beta * old_abs if old is not None else 0) + (1 - beta) * g.abs()
        self.gbar[name] = (t, new, new_abs)
        return new / (1 - beta ** t), new_abs / (1 - beta ** t)

    def step(self, grads: dict) -> dict:
        """{layer name: LayerResult} for this step (raw layers absent), from `grads` {parameter: the gradient
        the library saw}; the captured inputs are used up. Warm-up steps: {}."""
        self.nonfinite = []
        if self.warmed < self.opts.warmup_steps:
            self.warmed += 1
            self.clear()
            return {}
        refresh = self.step_count % self.opts.precond_every == 0
        report = refresh and self.opts.health_every > 0 and self.refreshes % self.opts.health_every == 0
        group_g = self.groups(grads) if refresh and self.opts.weak_share_bound is not None else {}
        self.choices = {}
        out = {}
        for layer in self.layers:
            g = grad_matrix(layer, grads)
            if g is None:
                continue
            if refresh:
                op = self._operator(layer, group_g.get(layer.name), report)
                if op is not None:
                    self.cache[layer.name] = op
            op = self.cache.get(layer.name)
            if not bool(g.isfinite().all()):
                self.nonfinite.append(layer.name)
            if op is None or layer.name in self.nonfinite:
                continue
            gbar, gabs = self._gbar(layer.name, g)
            cancel = float(gabs.norm() / gbar.norm()) if float(gbar.norm()) > 0 else 1.0
            alternatives = [(o, o.apply(gbar)) for _, o in self.choices.get(layer.name, [])[1:]] if refresh else []
            out[layer.name] = LayerResult(layer.name, op.apply(gbar), gbar, op, refresh, cancel, alternatives)
        self.refreshes += int(refresh)
        self.step_count += 1
        self.clear()
        return out
