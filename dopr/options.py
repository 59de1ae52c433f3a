"""DoPr's options, declared once: :class:`DoPrOptions` holds each option's default, its one-line meaning and
its check (DoPr, dopr.build, the ``ap`` config group's check and docs/library.md's table read it).

``damping``, ``grad_ema`` and ``precond_ema`` may be functions of the step (``damping=lambda step: 1e-2 if
step < 100 else 1e-4``): ``step`` counts the optimizer's steps before this one, warm-up included; the value is
checked when it is read.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Tuple, Union

import numpy as np

from . import damping, refresh_policy, solvers
from .sample_space import sample_space_blocker
from . import refresh_drift  # noqa: F401  registers refresh_policy="drift" before an option is checked

DAMPING_MODES = damping.TRACE_MODES
CONV2D_MODES = ("full", "sua")
NONFINITE = ("skip", "raise")
#: where the cholesky solve runs (dopr/sample_space.py)
SOLVE_SPACES = ("auto", "features", "samples")
#: refresh_policy="drift"'s test (dopr/refresh_drift.py)
DRIFT_TESTS = refresh_drift.TESTS

Schedule = Callable[[int], float]


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _plain(v):
    """A numpy scalar (accepted, as torch.optim accepts them) as the Python int, float or bool it holds, so that
    options, checkpoints and logs hold plain values; anything else unchanged."""
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, bool) or type(v) in (int, float) or not isinstance(v, numbers.Real):
        return v
    return int(v) if isinstance(v, numbers.Integral) else float(v)


def _option(default, doc: str, valid: Callable, rule, label: Optional[str] = None, show=str,
            scheduled: bool = False):
    """A field of DoPrOptions: ``doc`` its meaning; ``valid(value)`` its check, ``rule`` (or a function giving it)
    what the error says it must be, ``label`` and ``show`` the error's name and printing of it; ``scheduled``: it
    may be a function of the step."""
    return field(default=default, metadata=dict(doc=doc, valid=valid, rule=rule, label=label, show=show,
                                                 scheduled=scheduled))


@dataclass(frozen=True)
class DoPrOptions:
    """The activation preconditioner's options (every keyword of ``DoPr`` besides model and base).

    Frozen: ``options.replace(damping=1e-3)`` is a checked copy. An invalid value raises
    ``ValueError("Invalid <name>: <value> (<what it must be>)")``; a float option given as a numeric string (YAML's
    "1e-4") is read as the float. The fields are listed below (generated from their declarations).
    """

    damping: Union[float, Schedule] = _option(
        1e-4, "gamma >= 0, the damping's scale (see damping_mode); may be a function of the step",
        lambda v: _number(v) and 0.0 <= v < math.inf, "must be a finite number >= 0", scheduled=True)
    damping_mode: str = _option(
        "trace", "lambda = gamma * tr(Sigma) (trace, Algorithms 1-2), gamma * tr(Sigma) / d (trace_per_dim, "
        "the appendix paragraph 'Damping'), gamma (absolute) or gamma * (tr(Sigma) - Sigma_hh) (trace_activations: "
        "the activation block's trace, without the homogeneous 1 of a layer with a bias; issue 48)",
        lambda v: v in DAMPING_MODES, f"choose from {DAMPING_MODES}", show=repr)
    grad_ema: Union[float, Schedule] = _option(
        0.0, "EMA rate beta_g of G in [0, 1), bias-corrected; 0: the batch gradient; may be a function of the step",
        lambda v: _number(v) and 0.0 <= v < 1.0, "must be in [0, 1)", scheduled=True)
    precond_ema: Union[float, Schedule] = _option(
        0.0, "EMA rate beta_Sigma of Sigma in [0, 1), bias-corrected; 0: the batch covariance (the paper's "
        "default); may be a function of the step",
        lambda v: _number(v) and 0.0 <= v < 1.0, "must be in [0, 1)", scheduled=True)
    solver: str = _option(
        "cholesky", "how (Sigma + lambda I)^-1 is applied: cholesky, eigh, rank1_diag, rankk_diag, newton_schulz, "
        "span (the pseudo-inverse of the undamped Sigma on the directions the data supports, no damping; "
        "span_rcond, span_cap) or any registered with dopr.solvers.register_solver",
        lambda v: v in solvers.SOLVERS, lambda: f"choose from {tuple(solvers.SOLVERS)}", show=repr)
    solve_space: str = _option(
        "auto", "where the cholesky solve runs: auto (in sample space, n x n, for a layer whose rows this step are "
        "fewer than its dim d where the device's measured table, else a FLOP rule, says it is the faster, and nothing "
        "needs the d x d Sigma; dopr/solve_space.py, dopr/sample_space.py), features (always the d x d Sigma) or "
        "samples (always the rows)",
        lambda v: v in SOLVE_SPACES, f"choose from {SOLVE_SPACES}", show=repr)
    precond_every: int = _option(
        1, "refactor every k steps, gathering statistics on those steps, and reuse each layer's last good "
        "inverse in between (a layer with none gets one from the next step it runs on); 1 is the exact algorithm",
        lambda v: _integer(v) and v >= 1, "must be an integer >= 1")
    refresh_policy: str = _option(
        "every", "when a layer's factor is refreshed: every (every precond_every-th step, every layer) or any policy "
        "registered with dopr.refresh_policy.register_policy",
        lambda v: v in refresh_policy.policies(), lambda: f"choose from {refresh_policy.policies()}", show=repr)
    drift_threshold: float = _option(
        0.1, "refresh_policy drift: a group is refreshed on the step after max_j |s_j / r_j - 1| passes this, s_j the "
        "inputs' second moment along the probe w_j = P u_j (4 random u_j drawn at its last refresh, P its factor) and "
        "r_j that of the Sigma it was factored from; a relative change (batch noise alone is about sqrt(2 / rows)); "
        "inf: precond_every's cap alone (dopr/refresh_drift.py)",
        lambda v: _number(v) and v > 0, "must be a number > 0 (inf: the cap alone)")
    drift_test: str = _option(
        "plain", "refresh_policy drift's test: plain (max_j |s_j / r_j - 1| > drift_threshold, r_j from the Sigma "
        "the factor was made from) or noise (r_j from the first batch after the refresh, out of sample, and a group "
        "refreshed when |s_j / r_j - 1| passes drift_threshold by more than 3 standard errors, each estimated from "
        "the batches' per-sample fourth moments; dopr/refresh_drift.py)",
        lambda v: v in DRIFT_TESTS, f"choose from {DRIFT_TESTS}", show=repr)
    conv2d: str = _option(
        "full", "Conv2d covariance: full (im2col patches) or sua (channels, spatially uncorrelated)",
        lambda v: v in CONV2D_MODES, f"choose from {CONV2D_MODES}", label="conv2d mode", show=repr)
    homogeneous: bool = _option(
        True, "layers with a bias append a constant 1 to their input (affine invariance)",
        lambda v: isinstance(v, (bool, np.bool_)), "must be True or False", show=repr)
    rank: int = _option(
        8, "k, the number of eigen-directions rankk_diag keeps",
        lambda v: _integer(v) and v >= 1, "must be an integer >= 1")
    eigh_rcond: float = _option(
        1e-6, "relative eigenvalue cutoff of the pseudo-inverse (eigh and the Cholesky fallback)",
        lambda v: _number(v) and 0.0 <= v < 1.0, "must be in [0, 1)")
    span_rcond: float = _option(
        1e-6, "span solver: a direction is supported when its eigenvalue exceeds span_rcond * the largest (and "
        "d * the dtype's eps * the largest, eigh's rounding); the rest get 0",
        lambda v: _number(v) and 0.0 <= v < 1.0, "must be in [0, 1)")
    span_cap: float = _option(
        100.0, "span solver: no supported direction is amplified more than span_cap / mean eigenvalue "
        "(1 / max(e_i, mean(e) / span_cap)); inf: the exact pseudo-inverse",
        lambda v: _number(v) and 1.0 <= v <= math.inf, "must be a number >= 1 (inf: no cap)")
    on_nonfinite: str = _option(
        "skip", "a non-finite Sigma or G: skip (raw gradient to the GP for that layer and step, counted, "
        "warned once) or raise",
        lambda v: v in NONFINITE, f"choose from {NONFINITE}", show=repr)
    warmup_steps: int = _option(
        0, "the first k steps are the GP's alone (raw gradients, no statistics), the paper's advice for "
        "adaLN-Zero models",
        lambda v: _integer(v) and v >= 0, "must be an integer >= 0")
    clip_precond_norm: Optional[float] = _option(
        None, "clip the global norm of what the GP receives (M) after the AP; None: no clipping "
        "(clip_grad_norm_ before step() clips G, not M)",
        lambda v: v is None or (_number(v) and v > 0), "must be > 0 or None")
    health_every: int = _option(
        0, "every k-th refresh, a health report per dense layer in stats()['health'] (dopr/health.py); 0: never",
        lambda v: _integer(v) and v >= 0, "must be an integer >= 0")
    weak_share_bound: Optional[float] = _option(
        None, "damping set by the health report (issue 48): on each health refresh (health_every), each dense "
        "layer's lambda is raised by the smallest power of 2 (up to 2^20) that keeps at most this share of ||M||^2 "
        "in directions carrying under 1e-4 of its input variance (dopr.damping.damping_scale), held until the "
        "next; damping then sets the floor; None: off",
        lambda v: v is None or (_number(v) and 0.0 < v < 1.0), "must be in (0, 1) or None")
    weak_share_estimate: str = _option(
        "spectrum", "how weak_share_bound measures the share: spectrum (one float64 eigendecomposition per layer, on "
        "the health report's refreshes) or filter (batched Cholesky solves with the soft indicator "
        "tau^2 / (e^2 + tau^2), no eigendecomposition and no host sync, on every refresh; "
        "dopr.damping.filtered_damping_scale)",
        lambda v: v in damping.estimates(), lambda: f"choose from {damping.estimates()}", show=repr)
    damping_rule: str = _option(
        "trace", "how lambda is chosen: trace (damping_mode's scale times damping, the paper's; weak_share_bound "
        "raises it) or sample_count (lambda from each dense layer's q = d / N_eff by the Marchenko-Pastur lower "
        "edge, damping then a floor; dopr.damping.SampleCountRule, docs/library.md 'The sample-count damping rule'; "
        "sample_count_seen: the same, at q > 1 tr(Sigma) / (4 N_eff) instead of tr(Sigma) / (4 d))",
        lambda v: v in damping.rules(), lambda: f"choose from {damping.rules()}", show=repr)
    cuda_graphs: str = _option(
        "auto", "auto: on CUDA, a refresh step whose plan (layers, sizes, routes) repeats is captured into a CUDA graph "
        "and replayed (the default path only: cholesky, trace rule, no EMA; dopr/graphs.py), the same M bit for bit; "
        "off: every step eager",
        lambda v: v in ("auto", "off"), "choose from ('auto', 'off')", show=repr)
    skip_layers: Tuple[str, ...] = _option(
        (), "module names (a name covers the modules inside it) or class names left to the GP with raw gradients",
        lambda v: isinstance(v, tuple) and all(isinstance(k, str) and k for k in v),
        "must be a list of module or class names", show=repr)

    def __post_init__(self) -> None:
        if not isinstance(self.skip_layers, str):
            try:
                object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
            except TypeError:
                pass   # not iterable: the check below names it
        for f in dataclasses.fields(self):
            value = _numeric_string(f, getattr(self, f.name))
            if not (f.metadata["scheduled"] and callable(value)):
                check(f, value)
                object.__setattr__(self, f.name, _plain(value))
        if self.weak_share_bound is not None and self.health_every == 0 and self.weak_share_estimate == "spectrum":
            raise ValueError(f"weak_share_bound={self.weak_share_bound} sets the damping from the health report, "
                             "which health_every=0 never makes: set health_every >= 1 (the report's cadence, in "
                             "refreshes), or weak_share_estimate='filter', which chooses on every refresh")
        if self.weak_share_bound is not None and self.damping_rule != "trace":
            raise ValueError(f"weak_share_bound={self.weak_share_bound} raises the trace rule's lambda, and "
                             f"damping_rule={self.damping_rule!r} chooses another rule: set one of them")

        if self.solve_space == "samples" and (why := sample_space_blocker(self)) is not None:
            raise ValueError(f"Invalid solve_space: 'samples' ({why}; use 'auto' or 'features')")

    @classmethod
    def of(cls, options=None, **overrides) -> "DoPrOptions":
        """DoPr's ``options`` argument (a DoPrOptions, a mapping of some fields or None) with ``overrides`` applied."""
        if options is None:
            options = cls()
        elif isinstance(options, Mapping):
            options = cls.from_dict(options)
        elif not isinstance(options, cls):
            raise TypeError(f"Invalid options: {options!r} (a DoPrOptions, a dict or None; the options by name "
                            "are keywords, e.g. DoPr(model, base, damping=1e-3))")
        return options.replace(**overrides) if overrides else options

    @classmethod
    def names(cls) -> tuple:
        """The options' names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, options) -> "DoPrOptions":
        """From a mapping of (some) options, the rest at their defaults; an unknown name is a TypeError."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise TypeError(f"unknown DoPr option(s) {unknown}; the options are {list(cls.names())}")
        return cls(**options)

    def replace(self, **overrides) -> "DoPrOptions":
        """A copy with ``overrides`` applied (an unknown name is a TypeError), checked again."""
        return type(self).from_dict({**self.as_dict(), **overrides})

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.names()}

    def at(self, name: str, step: int):
        """The value of option ``name`` at ``step`` (a function of the step is called and its value checked)."""
        value = getattr(self, name)
        if callable(value):
            value = value(step)
            check(_FIELDS[name], value, f" at step {step}")
        return _plain(value)

    def __getitem__(self, name: str):
        """``options["damping"]``, as when DoPr's options were a dict."""
        if name not in _FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def describe(self) -> dict:
        """Plain values for a checkpoint or a log: a function of the step as ``"<function of the step: name>"``."""
        return {k: f"<function of the step: {getattr(v, '__qualname__', type(v).__name__)}>" if callable(v) else v
                for k, v in self.as_dict().items()}


_FIELDS = {f.name: f for f in dataclasses.fields(DoPrOptions)}
#: the float-valued options: a numeric string is read as its float (PyYAML loads 1e-4 as a string)
_FLOATS = frozenset(f.name for f in dataclasses.fields(DoPrOptions) if "float" in str(f.type))


def _numeric_string(f: dataclasses.Field, value):
    """float(value) for a float-valued option given as a numeric string, else value unchanged."""
    if f.name in _FLOATS and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def check(f: dataclasses.Field, value, where: str = "") -> None:
    """Raise ValueError naming the option and the bad value: ``Invalid damping: -1.0 (must be ...)``."""
    m = f.metadata
    if not m["valid"](value):
        rule = m["rule"]() if callable(m["rule"]) else m["rule"]
        if type(value) not in (int, float, bool, str, tuple, list, type(None)):   # its type: np.array(2) prints 2
            rule = f"a {type(value).__module__}.{type(value).__qualname__}: {rule}"
        text = isinstance(value, str) and m["show"] is str      # a string for a number: name its type
        shown = f"got str {value!r}" if text else m["show"](value)
        raise ValueError(f"Invalid {m['label'] or f.name}: {shown}{where} ({rule})")


def check_options(options: dict) -> dict:
    """The options of a mapping, checked, as a dict with the others at their defaults."""
    return DoPrOptions.from_dict(options).as_dict()


def options_table() -> str:
    """The Markdown table of DoPr's options (docs/library.md holds it; a test keeps the two equal)."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(DoPrOptions):
        rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['doc']} |")
    return "\n".join(rows)


DoPrOptions.__doc__ += "\n    Fields:\n\n" + "\n".join(
    f"    - ``{f.name}`` (default ``{f.default!r}``): {f.metadata['doc']}." for f in dataclasses.fields(DoPrOptions))
