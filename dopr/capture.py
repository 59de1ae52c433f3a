"""Activation capture: forward hooks on the preconditioned layers that gather, for each optimizer step, the
statistics of exactly the forwards whose gradients that step receives (docs/library.md, "Statistics follow the
gradient they belong to").

A forward counts when the gradient reaches the layer's own autograd node (a pre-hook) in a backward pass that
computes the weight's gradient; eval-mode and no-grad forwards never count. A clear of the weight's gradient
by any means drops the statistics gathered for it: checked once per backward pass before the next accumulation
(the gradient is None, or changed in place since and all zero). Micro-batches accumulate; a checkpoint's
recomputed forward is not counted again. Layers that read the very same input tensor share one statistic.
Under ``torch.compile`` statistics reach the step through probe leaves (dopr/compiled.py), offered as eager's
are. The hooks hold the capture weakly: a deleted optimizer, a deep-copied or pickled model leave inert hooks.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from . import sharding
from .sample_space import accumulate
from .compiled import Probes, hook_guards_skipped
from . import quantities
from .statistics import ActivationStatistics


def _graph_task() -> int:
    """The autograd graph task (one backward or autograd.grad call) now running, -1 outside backward."""
    return torch._C._current_graph_task_id()


def _receives_grad(weight: Tensor, node=None) -> bool:
    """Whether the backward pass now running computes `weight`'s gradient (not so under ``autograd.grad``
    with respect to other tensors, or ``backward(inputs=...)`` without the weight)."""
    if not weight.requires_grad:
        return False
    try:
        return torch._C._will_engine_execute_node(node if node is not None else _grad_node(weight))
    except RuntimeError:  # autograd.grad with the weight among its inputs: its gradient is returned
        return True


def _grad_node(t: Tensor):
    """The autograd node that receives `t`'s gradient: its AccumulateGrad for a leaf, else its grad_fn."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]


def _relink_hooks(t: Tensor) -> None:
    """Hand a leaf's gradient hooks to its tensor data again: ``torch.utils.swap_tensors`` (``Module._apply``
    under the swap flag) leaves the hook dicts on the Python tensor but not on its new data; setting links them."""
    for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, attr)
        if hooks is not None:
            setattr(t, attr, hooks)


def _in_functorch_transform() -> bool:
    """Whether a torch.func transform runs (batched or wrapped tensors: DoPr gathers nothing there)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _as_multiplied(x: Tensor) -> Tensor:
    """The input as the layer's GEMM reads it: under autocast a float32 input is cast to the autocast dtype
    (Sigma is the covariance of what the layer multiplies, as its weight gradient is); else x as it is."""
    if x.dtype is torch.float32 and torch._C._is_any_autocast_enabled() and not torch.compiler.is_compiling():
        dev = x.device.type
        if torch._C._is_autocast_available(dev) and torch.is_autocast_enabled(dev):
            return x.to(torch.get_autocast_dtype(dev))
    return x


def _in_backward() -> bool:
    """True in a backward pass (checkpoint recomputation); only an optimisation, commits decide what counts."""
    return _graph_task() != -1


class _ParamHook:
    """A weight's (or probe's) gradient hook that holds the capture weakly (see _ForwardHook)."""

    def __init__(self, capture: "ActivationCapture", index: int, method: str) -> None:
        self.capture, self.index, self.method = weakref.ref(capture), index, method

    def __call__(self, arg):
        capture = self.capture()
        if capture is not None:
            getattr(capture, self.method)(self.index)
        return None


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
            return capture.on_forward(self.index, module, inputs, output)
        return None

    def __deepcopy__(self, memo):
        return type(self)(None, self.index)

    def __reduce__(self):
        return (type(self), (None, self.index))


class _WeightInUse(_ForwardHook):
    """Forward pre-hook on an FSDP2 layer: records the unsharded weight its forward uses (its gradient
    decides which forwards count)."""

    def __call__(self, module, inputs):
        capture = self.capture() if self.capture is not None else None
        if capture is not None and not torch.compiler.is_compiling():
            capture.in_use[self.index] = module.weight


#: autograd nodes that only reshape their input: the layer's own node is the first one below them
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",
                         "AsStridedBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
                         "TransposeBackward0", "PermuteBackward0", "TBackward0", "ExpandBackward0"})


def _producer(output: Tensor):
    """The autograd node of the layer's own operation below any views of its result: it runs iff the output
    is backpropagated, even when modified in place (ReLU(inplace=True) rebases a view's history)."""
    node = output.grad_fn
    while node.name() in _VIEW_NODES and node.next_functions and node.next_functions[0][0] is not None:
        node = node.next_functions[0][0]
    return node


def _commit_hook(capture: "ActivationCapture", index: int, cap: _Capture, saved: Optional[Tensor], weight: Tensor):
    ref = weakref.ref(capture)
    counted = None   # the layer's list of commits this forward was counted into (see ActivationCapture.commit)

    def hook(grad_outputs):
        nonlocal counted
        c = ref()
        if c is not None:
            counted = c.commit(index, cap, saved, weight, counted)

    return hook


class LayerRecord:
    """What one preconditioned layer gathered since the last step."""

    __slots__ = ("helper", "stat", "owned", "sig", "snap", "compiled", "checked", "missed")

    def __init__(self, helper) -> None:
        self.helper = helper
        self.reset()

    def reset(self) -> None:
        self.stat: Optional[ActivationStatistics] = None
        self.owned = False  # False while `stat` is the shared capture's object (copy on second add)
        self.sig: list = []  # the captures committed, in order: layers with equal sig share Sigma (a new
        # list whenever the statistics are dropped, so a forward knows whether it already counted in them)
        self.snap = None  # (data_ptr, version) of the weight's gradient after the last counted accumulation
        self.compiled = False  # `stat` came from probes: its count is a tensor until groups()
        self.checked = None  # the backward pass (graph task) that last ran before_accumulation
        self.missed = None   # a forward that gathered nothing ran: "eval" (module.training False) or "no_grad"


class ActivationCapture:
    """The hooks on `helpers`' modules, gathering statistics of type `statistic` while `collecting`: when the
    refresh object says so (``refresh.gathering``, dopr/refresh.py), but inside :meth:`paused`."""

    def __init__(self, helpers: list, statistic: type, refresh, rows=None) -> None:
        self.layers = [LayerRecord(h) for h in helpers]
        self.statistic = statistic
        self.refresh = refresh   # asked whether forwards gather: its plain bool, so a compiled forward guards on it
        self.rows = rows   # dense layers' statistic where the solve may run in sample space (dopr/sample_space.py)
        self.reads: tuple = refresh.damping.reads   # the per-layer quantities each statistic carries (dopr/quantities.py)
        self._paused = False
        self.observer = None   # a refresh policy's observe(helper, x): training forwards that gather nothing (dopr/refresh_drift.py)
        self._captures: dict = {}
        self._nodes: dict = {}
        self.transformed = False   # a hooked forward ran under a torch.func transform (and gathered nothing)
        self._cid = itertools.count()
        self.probes = Probes(helpers, statistic)  # compiled forwards (dopr/compiled.py)
        self.handles = [h.module.register_forward_hook(_ForwardHook(self, i)) for i, h in enumerate(helpers)]
        # the weights as attached: under FSDP2 the module holds its unsharded weight during forward and
        # backward, whose grad FSDP2 frees after the reduce-scatter; the sharded parameter keeps it
        self.weights = [h.module.weight for h in helpers]
        self.sharded = [sharding.is_sharded(w) for w in self.weights]
        # registered after FSDP2's own pre-forward hook, which has unsharded the weight by then
        self.in_use = list(self.weights)
        self.handles += [h.module.register_forward_pre_hook(_WeightInUse(self, i))
                         for i, h in enumerate(helpers) if self.sharded[i]]
        self._weight_hooks: dict = {}   # {index: the handles of the hooks on that layer's weight}
        for i, h in enumerate(helpers):
            self._hook_weight(i, self.weights[i])
            for p in self.probes.leaves[i]:
                self.handles.append(p.register_post_accumulate_grad_hook(_ParamHook(self, i, "probe_accumulated")))
        # the hooks go when the capture does (its DoPr deleted or garbage-collected), not only on close()
        self._finalizer = weakref.finalize(self, _remove_handles, self.handles)

    def _hook_weight(self, index: int, w: Tensor) -> None:
        """The gradient hooks on layer `index`'s weight `w` (those on its previous weight removed)."""
        _remove_handles(self._weight_hooks.get(index, ()))
        hooks = [w.register_hook(_ParamHook(self, index, "before_accumulation"))] if w.requires_grad else []
        hooks.append(w.register_post_accumulate_grad_hook(_ParamHook(self, index, "accumulated")))
        self._weight_hooks[index] = hooks
        self.handles += hooks

    @property
    def collecting(self) -> bool:
        """Whether forwards now gather: as the refresh object says, but inside :meth:`paused`."""
        return self.refresh.gathering and not self._paused

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside gather nothing (one whose gradient is not the step's); then as the refresh says."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    def on_forward(self, index: int, module: nn.Module, inputs, output) -> None:
        if not (module.training and torch.is_grad_enabled() and self.collecting):
            if self.collecting:   # said if the layer then has a gradient but no statistics (no_forward_cause)
                self.layers[index].missed = "no_grad" if module.training else "eval"
            elif self.observer is not None and module.training and torch.is_grad_enabled():
                self._observe(index, inputs)
            return
        compiling = torch.compiler.is_compiling()   # (tracing runs under functorch's functionalization)
        if not compiling and _in_functorch_transform():   # vmap / grad / jacrev: batched or wrapped tensors
            self.transformed = True
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        layer, x = self.layers[index], inputs[0]
        if compiling:
            return self.probes.tap(index, output, self._statistics(layer.helper, x))
        if _in_backward():
            # a checkpoint recomputation: its output is backpropagated (and the statistics needed)
            # only under the reentrant variant, so compute them lazily, when that happens
            cap, saved = _Capture(None, None, next(self._cid)), _as_multiplied(x)
        else:
            cap, saved = self._capture(layer.helper, x), None
        # the weight this forward used: its gradient decides what counts. Under FSDP2 the unsharded one,
        # which a layer sharded on its own has already swapped out again by now
        weight = self.in_use[index] if self.sharded[index] else module.weight
        _producer(output).register_prehook(_commit_hook(self, index, cap, saved, weight))

    def _observe(self, index: int, inputs) -> None:
        """Hand a training forward's input to the observer (not compiled, transformed or recomputed forwards)."""
        if (torch.compiler.is_compiling() or _in_functorch_transform() or _in_backward() or not inputs
                or not isinstance(inputs[0], Tensor)):
            return
        with torch.no_grad():
            self.observer(self.layers[index].helper, _as_multiplied(inputs[0]))

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
        x = _as_multiplied(x)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            rows = self.rows is not None and not torch.compiler.is_compiling()   # probes carry Sigma's sums
            stat = helper.statistics(x, self.rows if rows and helper.statistic_type(self.statistic) is self.statistic
                                     else self.statistic)
            if self.reads and stat.kind in ("dense", "samples") and not torch.compiler.is_compiling():
                stat.extras = quantities.compute(self.reads, helper, x, int(stat.count))
            return stat

    def commit(self, index: int, cap: _Capture, saved: Optional[Tensor], weight: Tensor,
               counted: Optional[list] = None) -> Optional[list]:
        """The gradient reached the layer's operation: its statistics count if this backward pass computes the
        weight's gradient, once per forward and gradient (``retain_graph=True``: several passes add to one
        gradient). `counted`: the layer's commit list the forward was counted into (a clear starts a new one);
        returns the list it is counted in now."""
        layer = self.layers[index]
        self.before_accumulation(index)
        if layer.sig is counted or not self._receives_grad(index, weight):
            return counted
        if cap.stat is None:
            cap.stat = self._statistics(layer.helper, saved)
        self.commit_stat(layer, cap.stat, cap.cid)
        return layer.sig

    def _receives_grad(self, index: int, weight: Tensor) -> bool:
        """:func:`_receives_grad` through the cached AccumulateGrad node, checked again when it says no: a
        dtype or device change of the model gives the weight a new node, and the cached one is in no graph."""
        if not weight.requires_grad:   # frozen since the last step: no gradient (re-attached at the step)
            return False
        node = self._accumulator(index, weight)
        if node is None:
            return _receives_grad(weight)
        if _receives_grad(weight, node):
            return True
        current = _grad_node(weight)
        if current is node:
            return False
        self._nodes[index] = (weight, current)
        _relink_hooks(weight)
        return _receives_grad(weight, current)

    def _accumulator(self, index: int, weight: Tensor):
        """The weight's AccumulateGrad node, found once per layer and weight; None for a non-leaf weight. A new
        Parameter in the module (``Module._apply`` under the overwrite flag) becomes the layer's weight."""
        known = self._nodes.get(index)
        if known is None or known[0] is not weight:
            if weight.grad_fn is not None or not weight.requires_grad:
                return None
            known = self._nodes[index] = (weight, _grad_node(weight))
            if weight is not self.weights[index] and not self.sharded[index] and isinstance(weight, nn.Parameter):
                self.weights[index] = weight
                self._hook_weight(index, weight)
        return known[1]

    def before_accumulation(self, index: int) -> None:
        """Before the weight's gradient receives a contribution: if it was cleared since the last counted
        accumulation, its statistics go too. Once per backward pass, by whichever hook comes first."""
        layer, task = self.layers[index], _graph_task()
        if layer.checked == task:
            return
        layer.checked = task
        if layer.stat is None or layer.snap is None:   # nothing counted by an earlier accumulation
            return
        g = self.weights[index].grad
        if g is not None:
            if sharding.is_sharded(g):  # ranks hold other rows: only None is a clear all ranks agree on
                return
            if (g.data_ptr(), g._version) == layer.snap or bool(g.any()):
                return          # untouched, or changed in place (all-reduced, scaled) but not zeroed
        layer.stat, layer.owned, layer.sig, layer.compiled, layer.snap = None, False, [], False, None

    def accumulated(self, index: int) -> None:
        """The weight's gradient received this pass's contribution: remember its state, to tell a later clear."""
        layer = self.layers[index]
        g = self.weights[index].grad
        layer.snap = (g.data_ptr(), g._version) if g is not None and not sharding.is_sharded(g) else None

    def probe_accumulated(self, index: int) -> None:
        """A compiled forward's statistics arrived in the probes: offered as eager's are."""
        layer = self.layers[index]
        stat = self.probes.received(index, layer.helper.statistic_type(self.statistic))
        if stat is None:     # not every probe has its part yet
            return
        self.before_accumulation(index)
        layer.compiled = True
        self.commit_stat(layer, stat, next(self._cid))

    def commit_stat(self, layer: LayerRecord, stat: ActivationStatistics, cid: int) -> None:
        if layer.stat is None:
            layer.stat, layer.owned = stat, False
        else:
            extras = quantities.merged(layer.stat.extras, layer.stat.count, stat.extras, stat.count)
            if not layer.owned:
                layer.stat, layer.owned = layer.stat.clone(), True
            layer.stat = accumulate(layer.stat, stat)   # sums add, rows append
            if extras:                                  # (rows appended or turned into sums start without)
                layer.stat.extras = extras
        layer.sig.append(cid)

    def groups(self, names) -> OrderedDict:
        """{tuple of member names: statistics} for the layers in `names` that gathered any; layers whose
        committed captures are the same form one group."""
        Probes.merge_equal(self.layers)
        by_sig = OrderedDict()
        for layer in self.layers:
            if layer.helper.name in names and layer.stat is not None:
                by_sig.setdefault(tuple(layer.sig), []).append(layer)
        return OrderedDict((tuple(l.helper.name for l in ls), ls[0].stat) for ls in by_sig.values())

    def take_over(self, old: "ActivationCapture", warn: Callable) -> tuple:
        """(added, changed): this capture replaces `old` (a rebuild); layers `old` had keep their statistics, but
        not those whose bias was frozen or thawed (another dim). Returns the layer names new here and those whose
        dim changed, each kind said once by ``warn(what, message)``: their gradients are raw this step."""
        before = {l.helper.name: l for l in old.layers}
        changed = sorted(l.helper.name for l in self.layers if l.helper.name in before
                         and before[l.helper.name].helper.dim != l.helper.dim)
        for layer in self.layers:
            prev = before.get(layer.helper.name)
            if prev is not None and prev.stat is not None and layer.helper.name not in changed:
                layer.stat, layer.owned, layer.sig, layer.compiled = prev.stat, prev.owned, prev.sig, prev.compiled
        added = sorted(set(l.helper.name for l in self.layers) - set(before))
        if added:
            warn("attach", f"layers {added} train now: preconditioned from the next step on "
                 "(this step's gradient for them is raw; see DoPr.coverage())")
        if changed:
            warn("resized", f"layers {changed} froze or thawed their bias, which changes the AP's dimension: "
                 "preconditioned from the next step on, their EMAs restarted (this step's gradient for them is raw)")
        return added, changed

    def no_forward_cause(self, names, training: bool = True) -> str:
        """Why the layers `names`, which have a gradient, gathered no statistics since the last step (the model
        in train() mode: ``training``)."""
        if self.transformed:
            return ("forwards under a torch.func transform (vmap, grad, jacrev, functional_call inside them), "
                    "which gather no statistics: DoPr preconditions gradients of plain forward and backward passes")
        if training and hook_guards_skipped():
            return ("a torch.compile'd graph traced without DoPr's hooks (compiled before they were attached, "
                    "for another instance, or before a layer was unfrozen): call dopr.enable_compiled_capture() "
                    "before compiling")
        names = set(names)
        layers = [l for l in self.layers if l.helper.name in names]
        in_eval = [l.helper.name for l in layers if l.missed == "eval" or not l.helper.module.training]
        no_grad = [l.helper.name for l in layers if l.missed == "no_grad" and l.helper.name not in in_eval]
        idle = [l for l in layers if l.missed is None and l.helper.module.training]
        causes = []
        if in_eval:
            causes.append(f"a model left in eval() mode: {in_eval} are in eval() mode or ran their forwards in it, "
                          "which gather no statistics: call model.train()")
        if no_grad:
            causes.append(f"{no_grad} ran forwards only under torch.no_grad() or inference_mode, which gather no "
                          "statistics; their gradient came from elsewhere")
        if idle:
            grads = [l.helper.module.weight.grad for l in idle]
            zero = [l.helper.name for l, g in zip(idle, grads)
                    if g is not None and not sharding.is_sharded(g) and not bool(g.any())]
            rest = [l.helper.name for l in idle if l.helper.name not in zero]
            if zero:
                causes.append(f"{zero} in train() mode had no forward backpropagated to them since the last "
                              "step and hold an all-zero gradient left by zero_grad(set_to_none=False) (a head or "
                              "expert not used this step); with set_to_none=True, the default, they would have no "
                              "gradient and the GP would leave them alone")
            if rest:
                causes.append(f"{rest} in train() mode had no forward backpropagated to them since the last "
                              "step: their gradient is left from an earlier step (not cleared since) or set by hand")
        return "; ".join(causes)

    def pending_samples(self) -> dict:
        Probes.merge_equal(self.layers)
        return {l.helper.name: (l.stat.count if l.stat is not None else 0) for l in self.layers}

    def reset(self) -> None:
        self.transformed = False
        for layer in self.layers:
            layer.reset()
        self.probes.reset()
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
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for key in [k for k, h in hooks.items() if isinstance(h, _ForwardHook) and h.capture is None]:
                del hooks[key]
                n += 1
    return n
