"""DoPr: the activation preconditioner (AP) wrapped around any gradient preconditioner (GP).

Per preconditioned layer with weight W (rows x d) and input activations z (Algorithm 2 of the paper):

    Sigma  = mean over samples (and positions) of z z^T, from every training forward since the last step
    G_bar  = EMA_{grad_ema}(G),   Sigma_bar = EMA_{precond_ema}(Sigma)       (beta = 0: raw batch values)
    M      = G_bar (Sigma_bar + gamma * tr(Sigma_bar) * I)^-1                (AP)
    W     <- GP(M)                                                            (the base optimizer, unchanged)

Damping: Algorithms 1 and 2 write gamma * tr(Sigma) (``damping_mode="trace"``, the default); the appendix
paragraph "Damping" writes gamma * tr(Sigma) / d (``"trace_per_dim"``); ``"absolute"`` is gamma * I. The EMAs
start at zero and are bias-corrected as Adam's moments are. The pieces: dopr/capture.py (statistics),
dopr/refresh.py (factors), dopr/apply.py (M), dopr/checkpoint.py (the AP's state dict).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Mapping, Union

import torch
from torch import nn

from . import graphs, sharding, solvers
from .apply import Apply, Borrowed
from ._optimizer_surface import (HOOK_REGISTRIES, WrapsBase, init_hook_registries, refuse_base, refuse_foreign,
                                 refuse_foreign_group, with_load_hooks, with_state_dict_hooks)
from .capture import ActivationCapture, remove_inert_hooks
from .checkpoint import KEY, ap_state, load_ap_state
from .distributed import is_distributed
from .gp.base import evaluate
from .health import HealthReports
from .layers import find_layers
from .options import DoPrOptions
from .refresh import Factoring, Refresh
from .sample_space import row_statistic
from .statistics import STATISTICS


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose layers are hooked: inside DistributedDataParallel and torch.compile's wrapper."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
    sharding.check_supported(model)  # FSDP2 row shards are preconditioned as they are; FSDP1 / ZeRO-3 refused
    return model


class DoPr(WrapsBase, torch.optim.Optimizer):
    r"""Double Preconditioning: AP on the gradient, then the base optimizer (GP) unchanged.

    Args:
        model: the module (or DistributedDataParallel wrapper) whose layers are preconditioned.
        base: the gradient preconditioner, any ``torch.optim.Optimizer`` over (some of) the model's
            parameters. Its ``param_groups`` and ``state`` are this optimizer's.
        options: a :class:`dopr.options.DoPrOptions` (or a dict of some of its fields); ``None``: the
            defaults. Each field's default and meaning is in DoPrOptions (and docs/library.md's table).
        **overrides: options by name, applied over ``options``: ``DoPr(model, base, damping=1e-3)``.
            ``damping``, ``grad_ema`` and ``precond_ema`` may be functions of the step.

    Behaviours by design: docs/library.md, "By design".
    """

    #: the counters of :meth:`stats` (ints, 0 until counted); "steps" is the AP step counter itself
    COUNTERS = ("steps", "warmup_steps", "preconditioned", "refreshes", "factorizations", "cholesky_retries",
                "unreliable_factors", "eigh_fallbacks", "nonfinite_skips", "damping_choices", "damping_raises",
                "sample_space_solves", "sample_space_fallbacks", *graphs.COUNTERS)

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer,
                 options: Union[DoPrOptions, Mapping, None] = None, **overrides) -> None:
        if not isinstance(model, nn.Module):   # torch.optim's order, DoPr(model.parameters(), base): the hooks need layers
            raise TypeError(f"DoPr takes the model, not its parameters (got {type(model).__name__}): DoPr(model, base), "
                            "e.g. DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-3))")
        self.options = DoPrOptions.of(options, **overrides)
        refuse_base(base, "DoPr")   # a torch.optim.Optimizer that needs no closure (LBFGS re-evaluates the gradient)
        module = _unwrap(model)
        refuse_foreign(module, [p for g in base.param_groups for p in g["params"]],
                       "the base optimizer holds {n} parameter(s) that are not in the model (shapes {shapes}); "
                       "build it from model.parameters()")
        self.base, self.model = base, module
        self._sharded = any(sharding.is_sharded(p) for p in module.parameters())
        self._solver = solvers.SOLVERS[self.options.solver]
        self._factor_with = self._solver.bind(self.options)
        self._step, self._warmed = 0, 0   # AP steps and base-GP-only (warmup_steps) steps taken so far
        self._refresh = Refresh(self.options)   # statistics into factors: policy, damping, Sigma EMA, cache, counters
        self._apply = Apply(self.options)       # gradients into M: gradient EMA, buckets, read-back, repair, write-back
        self._health = HealthReports(self.options.health_every)
        self._warned, self._capture = set(), None
        self._attach()
        if not self._capture.layers:
            self.close()
            lines = "\n  ".join(str(e) for e in self._coverage) or "(no module has trainable parameters)"
            raise ValueError(f"the model has no preconditionable layer:\n  {lines}")
        init_hook_registries(self)  # param_groups and state are the base's: Optimizer.__init__ is not called

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base's zero_grad; the statistics since the last step go with their gradients (GradScaler's skip)."""
        self.base.zero_grad(set_to_none=set_to_none)
        if self._capture is not None:
            self._capture.reset()

    def add_param_group(self, param_group: dict) -> None:
        """The base's ``add_param_group``, for the model's parameters only."""
        refuse_foreign_group(self.model, param_group)
        self.base.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DoPr({type(self.base).__name__}, {', '.join(f'{k}={v}' for k, v in self.options.describe().items())})"

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)   # here once; base.step() gets none, a second one would undo the AP
        if self._signature() != self._layers_signature:   # a layer was (un)frozen or a param group added
            self._attach()
        if self.warming_up:                   # the base GP alone: raw gradients
            self._warmed += 1
            self._refresh.counts["warmup_steps"] += 1
            self._capture.reset()
            self._refresh.next_step(self._step, self.warming_up)
        else:
            with self._undone_on_raise():
                self.precondition()
        if self.options.clip_precond_norm is not None:
            params = [p for g in self.base.param_groups for p in g["params"] if p.grad is not None]
            self._last_clip_norm = float(torch.nn.utils.clip_grad_norm_(params, self.options.clip_precond_norm))
        self.base.step()
        return loss

    @contextlib.contextmanager
    def _undone_on_raise(self):
        """on_nonfinite="raise": a step that raises leaves no trace (counters, damping state, health, EMAs, factors)."""
        if self.options.on_nonfinite != "raise":
            yield
            return
        parts = (self._refresh, self._health, self._apply)
        saved = [part.snapshot() for part in parts]
        try:
            yield
        except BaseException:
            for part, state in zip(parts, saved):
                part.restore(state)
            raise

    def _signature(self) -> tuple:
        """What decides the preconditioned set: the base's parameters and which model parameters train."""
        return (tuple(id(p) for g in self.base.param_groups for p in g["params"]),
                tuple(p.requires_grad for p in self.model.parameters()))

    def _attach(self) -> None:
        """(Re)build the layer helpers and their hooks from what trains now (kept layers keep their statistics)."""
        helpers, self._coverage = find_layers(
            self.model, {id(p) for g in self.base.param_groups for p in g["params"]},
            {k: self.options[k] for k in ("homogeneous", "conv2d", "skip_layers")})
        old = self._capture
        self._capture = self._refresh.policy.attach(ActivationCapture(   # solve_space: rows instead of Sigma where n < d
            helpers, STATISTICS[self._solver.statistic], self._refresh, row_statistic(self.options)), self._health)
        self._attached_now = set()   # layers that started training this step: raw gradient, said once
        if old is not None:
            added, changed = self._capture.take_over(old, self._warn_once)   # each said once
            self._attached_now = set(added) | set(changed)
            self._refresh.forget(changed, set(l.helper.name for l in self._capture.layers))   # old dimension: no fit
            old.close()
        self._refresh.next_step(self._step, self.warming_up)
        self._layers_signature = self._signature()
        self._apply.buckets = {}   # and the CUDA graphs' plans (their counters kept)
        self._graphs = graphs.StepGraphs(graphs.static_reason(self.options, self._solver, self._refresh.damping, self._sharded),
                                         getattr(self, "_graphs", None))

    @property
    def warming_up(self) -> bool:
        """Whether the next step is one of the first ``warmup_steps`` (the GP alone)."""
        return self._warmed < self.options.warmup_steps

    @property
    def collecting(self) -> bool:
        """Whether forwards now gather statistics (:meth:`dopr.refresh.Refresh.gathers`)."""
        return self._refresh.gathers(self._step, self.warming_up)

    @torch.no_grad()
    def precondition(self) -> None:
        """Algorithm 2 on every preconditioned layer (called by :meth:`step`): G becomes M = Gbar (Sigmabar +
        lambda I)^-1 for the GP: factors (dopr/refresh.py), then the solve and write-back (dopr/apply.py)."""
        grads = {l.helper.name: l.helper for l in self._capture.layers if l.helper.has_grad()}   # G read later
        step = self._warmed + self._step                      # the optimizer's steps before this one
        self._refresh.begin(step, self.options, grads)
        self._apply.begin(step)
        collected, refresh, how = self.collecting, self._refresh.policy.gathers(self._step), self._factoring()
        groups, gathered, refresh, batches, ops, graphed, raw = (
            self._refresh.gather(self._capture, grads, refresh, self._step, self.options.at("damping", step), how)
            if collected else self._refresh.cached(grads, refresh, how))
        ops, solved = self._apply(ops, batches, grads, graphed, raw, self._refresh, self._borrowed())
        self._refresh.settle(ops, batches, grads, collected, refresh, gathered, self._attached_now, self._step, groups)
        self._refresh.counts["preconditioned"] += sum(len(s[0]) for s in solved)
        self._step += 1
        self._refresh.next_step(self._step, self.warming_up)
        self._capture.reset()

    def _borrowed(self) -> Borrowed:
        """What the apply object borrows for this step."""
        return Borrowed(self._helpers(), self._refresh.empty, self._attached_now, self._sharded, self._warn_once,
                        lambda names: self._capture.no_forward_cause(names, self.model.training))

    def _factoring(self) -> Factoring:
        """What the refresh borrows for this step's factors."""
        flags = {h.name: h.homogeneous for h in self.layers()} if self._refresh.damping.reads_homogeneous else None
        return Factoring(self._solver, self._factor_with, self._health, self._capture.statistic, flags,
                         self._sharded and is_distributed(), self.options.damping_mode, self._warn_once,
                         self._graphs, self._attached_now)

    def _warn_once(self, what: str, message) -> None:
        """Warn about ``what`` once per optimizer; ``message`` a string or a function giving it."""
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn("DoPr: " + (message() if callable(message) else message), RuntimeWarning, stacklevel=3)

    def layers(self) -> list:
        """The preconditioned layers' helpers (dopr/layers: ``name``, ``module``, ``input_dim()``...), in order."""
        return [l.helper for l in self._capture.layers]

    @property
    def refresh(self) -> Refresh:
        """The refresh object (dopr/refresh.py): policy, damping rule, Sigma EMA, cached factors, counters."""
        return self._refresh

    @property
    def apply(self) -> Apply:
        """The apply object (dopr/apply.py): the gradient EMA (``grad_ema``), the write-back buffers (``buckets``)."""
        return self._apply

    @property
    def capture(self) -> ActivationCapture:
        """The forward hooks that gather Sigma's statistics (dopr/capture.py); they ask the refresh object when."""
        return self._capture

    @property
    def graphs(self) -> graphs.StepGraphs:
        """The refresh step's CUDA graphs (dopr/graphs.py): ``off``, why none is used; ``counts``."""
        return self._graphs

    def coverage(self) -> list:
        """Every module with trainable parameters: preconditioned (mode, dim) or skipped (reason)."""
        return list(self._coverage)

    def coverage_table(self) -> str:
        """One line per module; a preconditioned layer's health report beside it once one was made."""
        return "\n".join(f"{e}  [{h}]" if (h := self._health.describe(e.name)) else str(e) for e in self._coverage)

    def pending_samples(self) -> dict:
        """{layer name: activation vectors gathered since the last step} (samples x positions)."""
        return self._capture.pending_samples()

    def stats(self) -> dict:
        """The :attr:`COUNTERS`, the layers with no forward / no samples on the last step, the health reports."""
        out = {k: 0 for k in self.COUNTERS}
        out.update(self._refresh.counters(), **self._graphs.counts, steps=self._step,
                   no_forward=list(self._apply.no_forward), no_samples=sorted(self._refresh.empty), **self._refresh.policy.stats())
        if self._health.reports:
            out["health"] = dict(self._health.reports)
        return out

    def state_dict(self) -> dict:
        """The base's state dict and the AP's entry ``"dopr"`` (:meth:`ap_state_dict`), torch.optim's hooks around."""
        return with_state_dict_hooks(self, lambda: {**self.base.state_dict(), KEY: self.ap_state_dict()})

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s: the base's, then the AP's entry (refused if missing), torch.optim's hooks around."""
        with_load_hooks(self, state_dict, self._load)

    def _load(self, state_dict: dict) -> None:
        ours, state_dict = state_dict.get(KEY), {k: v for k, v in state_dict.items() if k != KEY}
        if ours is None:
            raise ValueError("state_dict has no 'dopr' entry: it was not saved from a DoPr optimizer")
        self.base.load_state_dict(state_dict)
        self.load_ap_state_dict(ours)

    def ap_state_dict(self) -> dict:
        """The AP's own state (``state_dict()["dopr"]``): step, EMA buffers, cached inverses, counters, options.
        Under FSDP2 the gradient EMA buffers are gathered to whole matrices (a collective: every rank calls it;
        dopr.checkpoint adds this entry to ``get_optimizer_state_dict(model, opt.base)``'s)."""
        return ap_state(self.options, self._refresh, self._step, self._warmed,
                        self._apply.state_dict(self._helpers()))

    def load_ap_state_dict(self, ours: dict) -> None:
        """Restore :meth:`ap_state_dict`'s entry (FSDP2: each rank its rows of the EMAs), cast to each layer's
        statistics dtype and device as torch.optim casts its state (a sample-space factor stays float64)."""
        self._step, self._warmed = load_ap_state(ours, self.options, self._refresh, self._apply, self._helpers())
        self._refresh.next_step(self._step, self.warming_up)

    def _helpers(self) -> dict:
        return {h.name: h for h in self.layers()}

    def close(self) -> None:
        """Remove the forward hooks; the model is left as it was before DoPr."""
        if self._capture is not None:
            self._capture.close()

    def __enter__(self) -> "DoPr":   # `with DoPr(...) as opt:` closes the hooks on leaving
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    _TRANSIENT = ("_capture", "_solver", "_factor_with", "_graphs", *HOOK_REGISTRIES)

    def __getstate__(self) -> dict:
        """Everything but the hooks, the statistics gathered since the last step and the CUDA graphs."""
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._solver = solvers.SOLVERS[self.options.solver]
        self._factor_with = self._solver.bind(self.options)
        if "_refresh" not in state:   # a copy pickled before dopr/refresh.py
            self._refresh = Refresh.from_pickled(self.options, self.__dict__)
        if "_apply" not in state:     # a copy pickled before dopr/apply.py's Apply
            self._apply = Apply.from_pickled(self.options, self.__dict__)
        self._capture = None
        remove_inert_hooks(self.model)   # the copied model's hooks point at no optimizer
        self._attach()
        init_hook_registries(self)
