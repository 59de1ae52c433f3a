"""When a layer's factor is refreshed: the refresh policies (issue 75 item 3), one small class each.

DoPr asks its policy two things each step, and nothing else decides the refresh cadence:

* :meth:`RefreshPolicy.gathers`: whether this step's forwards gather statistics for a refresh (DoPr also gathers
  them, whatever the policy says, for layers that have a gradient but no factor yet);
* :meth:`RefreshPolicy.due`: of the groups (tuples of layer names sharing one Sigma) whose statistics were
  gathered, which get a new factor this step. The others keep their last factor, which DoPr caches whenever
  the policy says ``caches``.

``"every"`` (:class:`EveryK`): every ``precond_every``-th step refreshes every layer, the paper's Algorithm 2 at
k = 1; ``"drift"`` (:class:`dopr.refresh_drift.DriftPolicy`): a group when its probes say its Sigma moved, and
every layer at the k cap. A new policy is a new class here (or in a module that dopr/options.py imports, as
dopr/refresh_drift.py), registered with :func:`register_policy` under the ``refresh_policy`` value that chooses
it, with its own state (``state_dict`` / ``load_state_dict``, which the checkpoint keeps); dopr/optimizer.py does
not change. Optional hooks, no-ops here: :attr:`RefreshPolicy.observe` (the inputs of forwards that gather
nothing), :meth:`RefreshPolicy.refreshed` (the new factors), :meth:`RefreshPolicy.stats` (entries of
``DoPr.stats()``) and :meth:`RefreshPolicy.refresh_fractions` (shown in the health report).
"""
from __future__ import annotations

POLICIES: dict = {}


def register_policy(name: str):
    """Class decorator: ``DoPr(..., refresh_policy=name)`` refreshes as the class says."""
    def add(cls):
        cls.name = name
        POLICIES[name] = cls
        return cls
    return add


def policies() -> tuple:
    return tuple(POLICIES)


def build(options) -> "RefreshPolicy":
    return POLICIES[options.refresh_policy](options)


class RefreshPolicy:
    """When factors are refreshed. ``caches``: factors are kept between refreshes (a step may use an older one)."""

    name = "?"
    caches = True
    #: ``observe(helper, x)``: called by the capture, under no_grad, with the input of each training forward that
    #: gathers no statistics (a policy that watches the inputs between refreshes: "drift"); None: not called
    observe = None

    def __init__(self, options) -> None:
        self.options = options

    def gathers(self, step: int) -> bool:
        """Whether the forwards of AP step ``step`` (0 on the first) gather statistics for a refresh."""
        raise NotImplementedError

    def due(self, step: int, keys) -> set:
        """The group keys, of ``keys`` (those with statistics this step), that get a new factor at ``step``."""
        raise NotImplementedError

    def attach(self, capture, health):
        """DoPr's new capture (returned) and its health reports: the capture hands the inputs of forwards that gather
        nothing to :attr:`observe`, the reports show :meth:`refresh_fractions`."""
        capture.observer, health.fractions = self.observe, self.refresh_fractions
        return capture

    def refreshed(self, step: int, ops: dict, stats) -> None:
        """After step ``step`` factored the groups of ``ops`` ({group key: the cached operator}) from ``stats``
        ({group key: statistics}, whose sums the factorisation may have normalised in place)."""

    def stats(self) -> dict:
        """The policy's own entries of ``DoPr.stats()``."""
        return {}

    def refresh_fractions(self) -> dict:
        """{layer name: the share of its steps that refreshed it}, where the policy counts them (the health report)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@register_policy("every")
class EveryK(RefreshPolicy):
    """Every ``precond_every``-th step (k) gathers statistics and refreshes every layer; 1: every step, no cache."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.k = options.precond_every
        self.caches = self.k > 1

    def gathers(self, step: int) -> bool:
        return step % self.k == 0

    def due(self, step: int, keys) -> set:
        return set(keys) if step % self.k == 0 else set()

