"""DoPr: the activation preconditioner (AP) wrapped around any gradient preconditioner (GP).

Per preconditioned layer with weight W (rows x d) and input activations z (Algorithm 2 of the paper):

    Sigma  = mean over samples (and positions) of z z^T, from every training forward since the last step
    G_bar  = EMA_{grad_ema}(G),   Sigma_bar = EMA_{precond_ema}(Sigma)       (beta = 0: raw batch values)
    M      = G_bar (Sigma_bar + gamma * tr(Sigma_bar) * I)^-1                (AP)
    W     <- GP(M)                                                            (the base optimizer, unchanged)

Damping: Algorithms 1 and 2, the muP section and the invariance appendix write gamma * tr(Sigma);
only the appendix paragraph "Damping" writes gamma * tr(Sigma) / d. ``damping_mode="trace"`` (the
default) is what the algorithm boxes print, gamma * tr(Sigma); ``"trace_per_dim"`` is
gamma * tr(Sigma) / d (the mean eigenvalue times gamma, d times weaker), ``"absolute"`` is gamma * I.

EMAs start at zero and are bias-corrected (divided by 1 - beta^t), as Adam's moments are.

Statistics come from forward hooks but are committed only when the gradient reaches the layer's
output in backward: a forward counts iff it is backpropagated. Eval-mode and no-grad forwards
never count, micro-batches accumulate, and under activation checkpointing the recomputed forward
is not counted again (non-reentrant: its output is never backpropagated; reentrant: the first
forward runs without grad). Layers that read the very same input tensor (q, k, v projections)
share one covariance computation and one factorisation.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from collections import OrderedDict, defaultdict
from typing import Optional

import torch
from torch import Tensor, nn

from . import solvers
from .distributed import all_reduce_statistics
from .layers import find_layers
from .statistics import ActivationStatistics, statistics_dtype

DAMPING_MODES = ("trace", "trace_per_dim", "absolute")
CONV2D_MODES = ("full", "sua")
NONFINITE = ("skip", "raise")


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (checkpoint recomputation). Only an
    optimisation: correctness comes from committing statistics when the output is backpropagated."""
    return torch._C._current_graph_task_id() != -1


def _unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    for p in model.parameters():
        if type(p).__name__ in ("FlatParameter", "DTensor"):
            raise ValueError(
                "DoPr does not support parameter sharding (FSDP / ZeRO-3): it needs each layer's full "
                "weight gradient and input covariance on every rank. Use DistributedDataParallel."
            )
    return model


class _Capture:
    """One input tensor's statistics, shared by every layer that reads that tensor."""

    __slots__ = ("ref", "stat", "cid")

    def __init__(self, x: Optional[Tensor], stat: Optional[ActivationStatistics], cid: int):
        self.ref = weakref.ref(x) if x is not None else None
        self.stat, self.cid = stat, cid


class _ForwardHook:
    """Forward hook that holds the optimizer weakly; a deepcopied or pickled model gets an inert copy."""

    def __init__(self, opt: "DoPr", index: int) -> None:
        self.opt = weakref.ref(opt) if opt is not None else None
        self.index = index

    def __call__(self, module, inputs, output):
        opt = self.opt() if self.opt is not None else None
        if opt is not None:
            opt._on_forward(self.index, module, inputs, output)

    def __deepcopy__(self, memo):
        return _ForwardHook(None, self.index)

    def __reduce__(self):
        return (_ForwardHook, (None, self.index))


class _Layer:
    """Runtime record of one preconditioned layer."""

    __slots__ = ("helper", "stat", "owned", "sig")

    def __init__(self, helper) -> None:
        self.helper = helper
        self.reset()

    def reset(self) -> None:
        self.stat: Optional[ActivationStatistics] = None
        self.owned = False  # False while `stat` is the shared capture's object (copy on second add)
        self.sig: list = []


class DoPr(torch.optim.Optimizer):
    r"""Double Preconditioning: AP on the gradient, then the base optimizer (GP) unchanged.

    Args:
        model: the module (or DistributedDataParallel wrapper) whose layers are preconditioned.
        base: the gradient preconditioner, any ``torch.optim.Optimizer`` over (some of) the model's
            parameters. Its ``param_groups`` and ``state`` are this optimizer's.
        damping: gamma >= 0.
        damping_mode: ``"trace"`` (gamma * tr(Sigma), Algorithms 1-2, default), ``"trace_per_dim"``
            (gamma * tr(Sigma) / d, the appendix paragraph "Damping") or ``"absolute"`` (gamma).
        grad_ema, precond_ema: EMA rates beta_g, beta_Sigma in [0, 1); 0 uses the batch values.
        solver: ``"cholesky"``, ``"eigh"``, ``"rank1_diag"`` or ``"rankk_diag"`` (see dopr.solvers).
        precond_every: refactor every k steps and reuse the cached inverse in between; statistics
            are gathered on refresh steps only. 1 is the exact algorithm.
        conv2d: ``"full"`` (im2col patch covariance) or ``"sua"`` (spatially uncorrelated).
        homogeneous: append a constant 1 to the input of layers with a bias.
        rank: k for ``rankk_diag``.
        eigh_rcond: relative eigenvalue cutoff of the pseudo-inverse (``eigh`` and fallbacks).
        on_nonfinite: ``"skip"`` (raw gradient to the GP for that layer and step, counted, warned
            once) or ``"raise"``.
    """

    def __init__(
        self,
        model: nn.Module,
        base: torch.optim.Optimizer,
        damping: float = 1e-4,
        damping_mode: str = "trace",
        grad_ema: float = 0.0,
        precond_ema: float = 0.0,
        solver: str = "cholesky",
        precond_every: int = 1,
        conv2d: str = "full",
        homogeneous: bool = True,
        rank: int = 8,
        eigh_rcond: float = 1e-6,
        on_nonfinite: str = "skip",
    ) -> None:
        if not damping >= 0.0:
            raise ValueError(f"Invalid damping: {damping} (must be >= 0)")
        if damping_mode not in DAMPING_MODES:
            raise ValueError(f"Invalid damping_mode: {damping_mode!r} (choose from {DAMPING_MODES})")
        for nm, beta in (("grad_ema", grad_ema), ("precond_ema", precond_ema)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid {nm}: {beta} (must be in [0, 1))")
        if solver not in solvers.SOLVERS:
            raise ValueError(f"Invalid solver: {solver!r} (choose from {solvers.SOLVERS})")
        if not (isinstance(precond_every, int) and precond_every >= 1):
            raise ValueError(f"Invalid precond_every: {precond_every} (must be an integer >= 1)")
        if conv2d not in CONV2D_MODES:
            raise ValueError(f"Invalid conv2d mode: {conv2d!r} (choose from {CONV2D_MODES})")
        if not rank >= 1:
            raise ValueError(f"Invalid rank: {rank} (must be >= 1)")
        if on_nonfinite not in NONFINITE:
            raise ValueError(f"Invalid on_nonfinite: {on_nonfinite!r} (choose from {NONFINITE})")
        if not isinstance(base, torch.optim.Optimizer):
            raise ValueError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")

        module = _unwrap(model)
        in_model = {id(p) for p in module.parameters()}
        base_params = [p for g in base.param_groups for p in g["params"]]
        foreign = [tuple(p.shape) for p in base_params if id(p) not in in_model]
        if foreign:
            raise ValueError(
                f"the base optimizer holds {len(foreign)} parameter(s) that are not in the model "
                f"(shapes {foreign[:5]}); build it from model.parameters()"
            )
        helpers, self._coverage = find_layers(
            module, {id(p) for p in base_params}, {"homogeneous": homogeneous, "conv2d": conv2d}
        )
        if not helpers:
            lines = "\n  ".join(str(e) for e in self._coverage) or "(no module has trainable parameters)"
            raise ValueError(f"the model has no preconditionable layer:\n  {lines}")

        self.base = base
        self.model = module
        self.options = dict(
            damping=damping, damping_mode=damping_mode, grad_ema=grad_ema, precond_ema=precond_ema,
            solver=solver, precond_every=precond_every, conv2d=conv2d, homogeneous=homogeneous,
            rank=rank, eigh_rcond=eigh_rcond, on_nonfinite=on_nonfinite,
        )
        self._kind = solvers.STATISTIC_KIND[solver]
        self._layers = [_Layer(h) for h in helpers]
        self._captures: dict = {}
        self._cid = itertools.count()
        self._handles = [
            h.module.register_forward_hook(_ForwardHook(self, i)) for i, h in enumerate(helpers)
        ]
        # AP state: step counter, EMA buffers, cached inverses (precond_every > 1), counters
        self._step = 0
        self._grad_ema: dict = {}
        self._precond_ema: dict = {}
        self._cache: dict = {}
        self._counts = defaultdict(int)
        self._no_forward: list = []
        self._warned: set = set()
        # what torch.optim.Optimizer.__init__ sets for hooks; param_groups/state are the base's
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    # ----------------------------------------------------------- torch.optim.Optimizer surface
    @property
    def param_groups(self):
        return self.base.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.base.param_groups = groups

    @property
    def state(self):
        return self.base.state

    @state.setter
    def state(self, state):
        self.base.state = state

    @property
    def defaults(self):
        return self.base.defaults

    @defaults.setter
    def defaults(self, value):
        self.base.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.base.add_param_group(param_group)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"DoPr({type(self.base).__name__}, {opts})"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.precondition()
        self.base.step()
        return loss

    # ------------------------------------------------------------------ statistics collection
    @property
    def collecting(self) -> bool:
        """Whether forwards now gather statistics (refresh steps only when precond_every > 1)."""
        return self._step % self.options["precond_every"] == 0

    def _on_forward(self, index: int, module: nn.Module, inputs, output) -> None:
        if not (module.training and torch.is_grad_enabled() and self.collecting):
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        layer, x = self._layers[index], inputs[0]
        if _in_backward():
            # a checkpoint recomputation: its output is backpropagated (and the statistics needed)
            # only under the reentrant variant, so compute them lazily, when that happens
            cap, saved = _Capture(None, None, next(self._cid)), x
        else:
            cap, saved = self._capture(layer.helper, x), None
        output.register_hook(_commit_hook(self, index, cap, saved))

    def _capture(self, helper, x: Tensor) -> _Capture:
        share = helper.share_key
        key = (id(x), share if share is not None else id(helper.module))
        cap = self._captures.get(key)
        if cap is None or cap.ref() is not x:
            cap = _Capture(x, self._statistics(helper, x), next(self._cid))
            if len(self._captures) > 4 * len(self._layers):
                self._captures = {k: c for k, c in self._captures.items() if c.ref() is not None}
            self._captures[key] = cap
        return cap

    def _statistics(self, helper, x: Tensor) -> ActivationStatistics:
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            return helper.statistics(x, self._kind)

    def _commit(self, index: int, cap: _Capture, saved: Optional[Tensor]) -> None:
        layer = self._layers[index]
        if cap.stat is None:
            cap.stat = self._statistics(layer.helper, saved)
        if layer.stat is None:
            layer.stat, layer.owned = cap.stat, False
        else:
            if not layer.owned:
                layer.stat, layer.owned = layer.stat.clone(), True
            layer.stat.add_(cap.stat)
        layer.sig.append(cap.cid)

    # ------------------------------------------------------------------------------ the AP
    @torch.no_grad()
    def precondition(self) -> None:
        """Replace each preconditioned layer's gradient by M; called by :meth:`step`."""
        refresh = self.collecting
        grads = {}
        for l in self._layers:
            g = l.helper.grad_matrix()
            if g is not None:
                grads[l.helper.name] = g
        skipped = set()
        if refresh:
            ops, skipped = self._factor(self._groups([l for l in self._layers if l.helper.name in grads]))
            if self.options["precond_every"] > 1:
                self._cache = {key: op.cached() for key, op in ops.items()}
        else:
            ops = self._cache
        group_of = {name: key for key in ops for name in key}
        skipped = {name for key in skipped for name in key}
        self._no_forward = [n for n in grads if n not in group_of and n not in skipped]
        if self._no_forward:
            self._warn_once("no_forward", f"no training forward since the last step for {self._no_forward}: "
                            "their gradients go to the GP unpreconditioned (see DoPr.stats())")
        bad = self._nonfinite({n: g for n, g in grads.items() if n in group_of})
        todo = defaultdict(list)
        for l in self._layers:
            name = l.helper.name
            if name in group_of and name not in bad:
                todo[group_of[name]].append(l)
        for key, members in todo.items():
            gs = [self._grad_ema_update(l.helper.name, grads[l.helper.name].to(statistics_dtype(grads[l.helper.name].dtype))) for l in members]
            ms = ops[key].apply(torch.cat(gs)) if len(gs) > 1 else ops[key].apply(gs[0])
            for l, m in zip(members, ms.split([g.shape[0] for g in gs])):
                l.helper.set_grad(m)
            self._counts["preconditioned"] += len(members)
        self._counts["steps"] += 1
        self._step += 1
        for l in self._layers:
            l.reset()
        self._captures = {}

    def _groups(self, layers) -> dict:
        """{tuple of member names: mean statistics}, layers with identical captures grouped."""
        by_sig = OrderedDict()
        for l in layers:
            if l.stat is not None:
                by_sig.setdefault(tuple(l.sig), []).append(l)
        groups = OrderedDict((tuple(l.helper.name for l in ls), ls[0].stat) for ls in by_sig.values())
        all_reduce_statistics(list(groups.values()))
        return groups

    def _factor(self, groups: dict) -> dict:
        opts = self.options
        gamma, mode = opts["damping"], opts["damping_mode"]
        means = {}
        bad = self._nonfinite({k: s.sums[0] for k, s in groups.items()}, what="activation covariance")
        for key, stat in groups.items():
            if key in bad:
                continue
            means[key] = (stat.kind, self._precond_ema_update(key, stat))
        ops, dense = {}, defaultdict(list)
        for key, (kind, m) in means.items():
            diag = m[0].diagonal() if kind == "dense" else (m[1] if kind == "moments" else m[0])
            lam = damping(gamma, mode, diag)
            if kind == "dense":
                dense[(m[0].shape[0], m[0].device)].append((key, m[0], lam))
            elif kind == "moments":
                ops[key] = solvers.factor_rank1(m[0], m[1], lam)
            else:
                ops[key] = solvers.factor_diagonal(m[0], lam)
        for batch in dense.values():
            keys = [b[0] for b in batch]
            sigma = torch.stack([b[1] for b in batch])
            lam = torch.stack([b[2].reshape(()) for b in batch]).to(sigma.dtype)
            if opts["solver"] == "cholesky":
                out = solvers.factor_cholesky(sigma, lam, opts["eigh_rcond"], self._counts)
            elif opts["solver"] == "eigh":
                out = solvers.factor_eigh(sigma, lam, opts["eigh_rcond"])
            else:
                out = solvers.factor_rankk(sigma, lam, opts["rank"])
            ops.update(zip(keys, out))
        self._counts["refreshes"] += 1
        self._counts["factorizations"] += len(ops)
        return ops, bad

    def _nonfinite(self, tensors: dict, what: str = "gradient") -> set:
        """Keys whose tensor has a non-finite entry (one device sync for all of them)."""
        if not tensors:
            return set()
        # one pass per tensor: a sum is finite unless an entry is non-finite (or it overflows,
        # which the exact per-tensor check below then clears)
        if bool(torch.stack([t.sum() for t in tensors.values()]).isfinite().all()):
            return set()
        bad = {k for k, t in tensors.items() if not bool(torch.isfinite(t).all())}
        if not bad:
            return set()
        names = sorted(n for k in bad for n in (k if isinstance(k, tuple) else (k,)))
        if self.options["on_nonfinite"] == "raise":
            raise FloatingPointError(f"non-finite {what} in DoPr layer(s) {names}")
        self._counts["nonfinite_skips"] += len(names)
        self._warn_once("nonfinite", f"non-finite {what} in {names}: AP skipped for them this step, "
                        "raw gradient to the GP (counted in DoPr.stats()['nonfinite_skips'])")
        return bad

    def _precond_ema_update(self, key, stat: ActivationStatistics) -> tuple:
        mean = stat.mean()
        beta = self.options["precond_ema"]
        if beta == 0.0:
            return mean
        name = "|".join(key)
        entry = self._precond_ema.setdefault(name, {"t": 0, "sums": None})
        packed = [_pack(t) if stat.kind == "dense" else t for t in mean]
        if entry["sums"] is None:
            entry["sums"] = [torch.zeros_like(p) for p in packed]
        entry["t"] += 1
        for buf, p in zip(entry["sums"], packed):
            buf.mul_(beta).add_(p, alpha=1.0 - beta)
        corr = 1.0 - beta ** entry["t"]
        out = [b / corr for b in entry["sums"]]
        return tuple(_unpack(o, t.shape[0]) if stat.kind == "dense" else o for o, t in zip(out, mean))

    def _grad_ema_update(self, name: str, g: Tensor) -> Tensor:
        beta = self.options["grad_ema"]
        if beta == 0.0:
            return g
        entry = self._grad_ema.setdefault(name, {"t": 0, "g": torch.zeros_like(g)})
        entry["t"] += 1
        entry["g"].mul_(beta).add_(g, alpha=1.0 - beta)
        return entry["g"] / (1.0 - beta ** entry["t"])

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn("DoPr: " + message, RuntimeWarning, stacklevel=3)

    # ---------------------------------------------------------------------- reporting
    def coverage(self) -> list:
        """Every module with trainable parameters: preconditioned (mode, dim) or skipped (reason)."""
        return list(self._coverage)

    def coverage_table(self) -> str:
        return "\n".join(str(e) for e in self._coverage)

    def pending_samples(self) -> dict:
        """{layer name: activation vectors gathered since the last step} (samples x positions)."""
        return {l.helper.name: (l.stat.count if l.stat is not None else 0) for l in self._layers}

    def stats(self) -> dict:
        out = dict(self._counts)
        for k in ("steps", "preconditioned", "refreshes", "factorizations", "nonfinite_skips",
                  "cholesky_retries", "eigh_fallbacks"):
            out.setdefault(k, 0)
        out["no_forward"] = list(self._no_forward)
        return out

    # ------------------------------------------------------------------ state and hooks
    def state_dict(self) -> dict:
        sd = self.base.state_dict()
        sd["dopr"] = {
            "step": self._step,
            "grad_ema": {k: {"t": v["t"], "g": v["g"].clone()} for k, v in self._grad_ema.items()},
            "precond_ema": {k: {"t": v["t"], "sums": [s.clone() for s in v["sums"]]} for k, v in self._precond_ema.items()},
            "cache": {"|".join(k): solvers.operator_state(op) for k, op in self._cache.items()},
            "counts": dict(self._counts),
            "options": dict(self.options),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("dopr", None)
        if ours is None:
            raise ValueError("state_dict has no 'dopr' entry: it was not saved from a DoPr optimizer")
        self.base.load_state_dict(state_dict)
        self._step = ours["step"]
        self._grad_ema = {k: {"t": v["t"], "g": v["g"].clone()} for k, v in ours["grad_ema"].items()}
        self._precond_ema = {k: {"t": v["t"], "sums": [s.clone() for s in v["sums"]]} for k, v in ours["precond_ema"].items()}
        self._cache = {tuple(k.split("|")): solvers.operator_from_state(s) for k, s in ours["cache"].items()}
        self._counts = defaultdict(int, ours["counts"])

    def close(self) -> None:
        """Remove the forward hooks; the model is left as it was before DoPr."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "DoPr":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def damping(gamma: float, mode: str, diag: Tensor) -> Tensor:
    """The absolute damping lambda added to Sigma's diagonal (``diag``): gamma * tr(Sigma) ("trace"),
    gamma * tr(Sigma) / d ("trace_per_dim") or gamma ("absolute")."""
    if mode == "trace":
        return gamma * diag.sum()
    if mode == "trace_per_dim":
        return gamma * diag.sum() / diag.numel()
    return torch.tensor(gamma, device=diag.device)


def _commit_hook(opt: DoPr, index: int, cap: _Capture, saved: Optional[Tensor]):
    ref = weakref.ref(opt)

    def hook(grad):
        o = ref()
        if o is not None:
            o._commit(index, cap, saved)

    return hook


def _pack(m: Tensor) -> Tensor:
    """Upper triangle of a symmetric matrix: d(d+1)/2 floats."""
    i, j = torch.triu_indices(m.shape[0], m.shape[0], device=m.device)
    return m[i, j]


def _unpack(p: Tensor, d: int) -> Tensor:
    i, j = torch.triu_indices(d, d, device=p.device)
    m = torch.zeros(d, d, dtype=p.dtype, device=p.device)
    m[i, j] = p
    m[j, i] = p
    return m
