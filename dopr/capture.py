"""Activation capture: forward hooks on the preconditioned layers that gather, for each optimizer
step, the statistics of exactly the forwards whose gradients that step receives.

Statistics come from forward hooks but are committed only when the gradient reaches the layer's
output in backward: a forward counts iff it is backpropagated. Eval-mode and no-grad forwards never
count, micro-batches accumulate, and under activation checkpointing the recomputed forward is not
counted again (non-reentrant: its output is never backpropagated; reentrant: the first forward runs
without grad). Layers that read the very same input tensor (q, k, v projections) share one
statistics computation, and then one factorisation.

The hooks hold the capture weakly: a deleted optimizer leaves inert hooks, and a deep-copied or
pickled model gets inert copies of them.
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor, nn

from .statistics import ActivationStatistics


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (checkpoint recomputation). Only an
    optimisation: correctness comes from committing statistics when the output is backpropagated."""
    return torch._C._current_graph_task_id() != -1


class _Capture:
    """One input tensor's statistics, shared by every layer that reads that tensor."""

    __slots__ = ("ref", "stat", "cid")

    def __init__(self, x: Optional[Tensor], stat: Optional[ActivationStatistics], cid: int):
        self.ref = weakref.ref(x) if x is not None else None
        self.stat, self.cid = stat, cid


class _ForwardHook:
    """Forward hook that holds the capture weakly; a deepcopied or pickled model gets an inert copy."""

    def __init__(self, capture: Optional["ActivationCapture"], index: int) -> None:
        self.capture = weakref.ref(capture) if capture is not None else None
        self.index = index

    def __call__(self, module, inputs, output):
        capture = self.capture() if self.capture is not None else None
        if capture is not None:
            capture.on_forward(self.index, module, inputs, output)

    def __deepcopy__(self, memo):
        return _ForwardHook(None, self.index)

    def __reduce__(self):
        return (_ForwardHook, (None, self.index))


def _commit_hook(capture: "ActivationCapture", index: int, cap: _Capture, saved: Optional[Tensor]):
    ref = weakref.ref(capture)

    def hook(grad):
        c = ref()
        if c is not None:
            c.commit(index, cap, saved)

    return hook


class LayerRecord:
    """What one preconditioned layer gathered since the last step."""

    __slots__ = ("helper", "stat", "owned", "sig")

    def __init__(self, helper) -> None:
        self.helper = helper
        self.reset()

    def reset(self) -> None:
        self.stat: Optional[ActivationStatistics] = None
        self.owned = False  # False while `stat` is the shared capture's object (copy on second add)
        self.sig: list = []  # the captures committed, in order: layers with equal sig share Sigma


class ActivationCapture:
    """The hooks on `helpers`' modules, gathering statistics of type `statistic` while `collecting`."""

    def __init__(self, helpers: list, statistic: type) -> None:
        self.layers = [LayerRecord(h) for h in helpers]
        self.statistic = statistic
        self.collecting = True
        self._captures: dict = {}
        self._cid = itertools.count()
        self.handles = [h.module.register_forward_hook(_ForwardHook(self, i)) for i, h in enumerate(helpers)]
        # the hooks go when the capture does (its DoPr deleted or garbage-collected), not only on close()
        self._finalizer = weakref.finalize(self, _remove_handles, list(self.handles))

    def on_forward(self, index: int, module: nn.Module, inputs, output) -> None:
        if not (module.training and torch.is_grad_enabled() and self.collecting):
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        layer, x = self.layers[index], inputs[0]
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
            if len(self._captures) > 4 * len(self.layers):
                self._captures = {k: c for k, c in self._captures.items() if c.ref() is not None}
            self._captures[key] = cap
        return cap

    def _statistics(self, helper, x: Tensor) -> ActivationStatistics:
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            return helper.statistics(x, self.statistic)

    def commit(self, index: int, cap: _Capture, saved: Optional[Tensor]) -> None:
        layer = self.layers[index]
        if cap.stat is None:
            cap.stat = self._statistics(layer.helper, saved)
        if layer.stat is None:
            layer.stat, layer.owned = cap.stat, False
        else:
            if not layer.owned:
                layer.stat, layer.owned = layer.stat.clone(), True
            layer.stat.add_(cap.stat)
        layer.sig.append(cap.cid)

    def groups(self, names) -> OrderedDict:
        """{tuple of member names: statistics} for the layers in `names` that gathered any; layers
        whose committed captures are the same (they read the same inputs) form one group."""
        by_sig = OrderedDict()
        for layer in self.layers:
            if layer.helper.name in names and layer.stat is not None:
                by_sig.setdefault(tuple(layer.sig), []).append(layer)
        return OrderedDict((tuple(l.helper.name for l in ls), ls[0].stat) for ls in by_sig.values())

    def pending_samples(self) -> dict:
        return {l.helper.name: (l.stat.count if l.stat is not None else 0) for l in self.layers}

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._captures = {}

    def close(self) -> None:
        _remove_handles(self.handles)
        self.handles = []
        self._finalizer.detach()


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


def remove_inert_hooks(model: nn.Module) -> int:
    """Drop the inert hook copies a deep-copied or unpickled model carries; returns how many."""
    n = 0
    for module in model.modules():
        for key in [k for k, h in module._forward_hooks.items() if isinstance(h, _ForwardHook) and h.capture is None]:
            del module._forward_hooks[key]
            n += 1
    return n
