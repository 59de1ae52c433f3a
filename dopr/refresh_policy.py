"""When a layer's factor is refreshed: the refresh policies (issue 75 item 3), one small class each.

DoPr asks its policy :meth:`RefreshPolicy.gathers` (whether this step's forwards gather statistics; DoPr also
gathers them for layers with a gradient but no factor yet) and :meth:`RefreshPolicy.due` (which of the groups
gathered get a new factor; the others keep their last one, cached when the policy ``caches``). ``"every"``
(:class:`EveryK`) refreshes every layer every ``precond_every``-th step, the paper's Algorithm 2 at k = 1;
``"drift"`` is dopr/refresh_drift.py. A new policy is a class registered with :func:`register_policy`, with its
own ``state_dict`` / ``load_state_dict``; the optional hooks below are no-ops here.
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
    #: ``observe(helper, x)``: called by the capture with the input of each training forward that gathers nothing
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
        """Hook DoPr's new capture (returned) to :attr:`observe` and its health reports to :meth:`refresh_fractions`."""
        capture.observer, health.fractions = self.observe, self.refresh_fractions
        return capture

    def refreshed(self, step: int, ops: dict, stats) -> None:
        """Step ``step`` factored the groups of ``ops`` ({group key: operator}) from ``stats`` ({key: statistics})."""

    def stats(self) -> dict:
        """The policy's own entries of ``DoPr.stats()``."""
        return {}

    def refresh_fractions(self) -> dict:
        """{layer name: the share of its steps that refreshed it}, where the policy counts them."""
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

