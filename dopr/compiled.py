"""The capture under ``torch.compile``.

A forward hook traced into a compiled graph may have no Python side effects, so the statistics travel through
autograd: the hook returns ``_Tap(output, probes, sums)``, the identity on the output, whose backward hands the
sums to per-layer *probe* leaves (one element strided to the sums' shape) as their gradient. Autograd accumulates
them exactly when the output is backpropagated: no graph break, ``fullgraph=True`` works, and a backward that asks
only for other gradients does not count, as in eager. Equal statistics of layers that may share one input (q, k, v)
are merged at the step and factored once (:meth:`Probes.merge_equal`).

Dynamo does not guard on module hooks by default, so a graph traced without DoPr's hooks may be reused for the
hooked model, which then gathers nothing; :func:`enable_compiled_capture` (the user's explicit, process-wide call)
turns those guards on.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import sharding
from .statistics import ActivationStatistics, statistics_dtype


def enable_compiled_capture() -> None:
    """Make ``torch.compile`` see DoPr's hooks (``torch._dynamo.config.skip_nnmodule_hook_guards = False``,
    process-wide); call it once, before compiling (``torch._dynamo.reset()`` retraces earlier graphs)."""
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False


def hook_guards_skipped() -> bool:
    """Whether dynamo compiled anything while skipping module-hook guards (a graph may lack DoPr's hooks)."""
    try:
        import torch._dynamo
        from torch._dynamo import convert_frame
    except Exception:  # pragma: no cover - a torch without dynamo
        return False
    return bool(torch._dynamo.config.skip_nnmodule_hook_guards) and any(
        ref() is not None for ref in convert_frame.input_codes.seen)


class _Tap(torch.autograd.Function):
    """out -> out; in backward, each probe's gradient is its statistic (the sums and the count)."""

    @staticmethod
    def forward(ctx, out, *probes_and_values):
        k = len(probes_and_values) // 2
        ctx.save_for_backward(*probes_and_values[k:])
        # a copy, not a view: a view returned by a custom Function may not be modified in place
        # (ReLU(inplace=True) after a Linear); in a compiled graph the copy fuses into its consumer
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        values = ctx.saved_tensors
        return (grad, *values, *(None,) * len(values))


class Probes:
    """Each layer's probe leaves (its statistic's sums, then the count) and what they received."""

    def __init__(self, helpers: list, statistic: type) -> None:
        self.statistic = statistic
        self.leaves = [self._make(h) for h in helpers]

    def _make(self, helper) -> tuple:
        """A leaf per sum and the count whose gradient collects it: one element of storage, strides 0."""
        w = helper.module.weight
        dtype, device = statistics_dtype(w.dtype), sharding.local(w).device
        shapes = helper.statistic_type(self.statistic).sum_shapes(helper.dim) + ((),)
        return tuple(torch.zeros((), dtype=dtype, device=device).expand(shape).detach().requires_grad_(True)
                     for shape in shapes)

    def tap(self, index: int, output: Tensor, stat: ActivationStatistics) -> Tensor:
        """Traced in the compiled forward: the output, carrying `stat` to the probes in backward."""
        count = torch.full((), stat.count, dtype=stat.sums[0].dtype, device=stat.sums[0].device)
        return _Tap.apply(output, *self.leaves[index], *stat.sums, count)

    def received(self, index: int, kind: type) -> Optional[ActivationStatistics]:
        """The statistic (of type `kind`) the layer's probes carry, taken out of them (the count a tensor until
        merge_equal); None until every probe has its part."""
        probes = self.leaves[index]
        if any(p.grad is None for p in probes):
            return None
        stat = kind.__new__(kind)
        stat.sums, stat.count = tuple(p.grad for p in probes[:-1]), probes[-1].grad.reshape(())
        for p in probes:
            p.grad = None
        return stat

    @staticmethod
    def merge_equal(layers: list) -> None:
        """Layers whose statistics came from probes: their counts to the host (one transfer), and layers with equal
        statistics (q, k, v of one input) made to hold one object."""
        found = [layer for layer in layers if layer.compiled and layer.stat is not None]
        if not found:
            return
        # one host transfer: each layer's count and a fingerprint (the sum of its first statistic)
        keys = torch.stack([torch.stack([torch.as_tensor(l.stat.count).reshape(()).to(torch.float64),
                                         l.stat.sums[0].sum().to(torch.float64)]) for l in found]).tolist()
        seen = []   # (share key, count, fingerprint, layer) of the statistics kept so far
        for layer, (count, fingerprint) in zip(found, keys):
            layer.stat.count, layer.compiled = count, False
            share = layer.helper.share_key
            twin = next((c for c in seen if share is not None and c[:3] == (share, count, fingerprint)
                         and all(torch.equal(a, b) for a, b in zip(c[3].stat.sums, layer.stat.sums))), None)
            if twin is not None:   # q, k, v of one input: the same statistics, one factorisation (as eager)
                layer.stat, layer.owned, layer.sig = twin[3].stat, False, list(twin[3].sig)
                continue
            seen.append((share, count, fingerprint, layer))

    def reset(self) -> None:
        for probes in self.leaves:
            for p in probes:
                p.grad = None
