"""Data parallel: every rank applies the same preconditioner, from the global batch's statistics,
Sigma = (sum_r S_r) / (sum_r n_r): every layer's sums and counts in one flat all-reduce per step.

Ranks need not run the same layers (``find_unused_parameters=True``): they first agree on one layout
(:func:`agree_groups`, 2 floats per layer).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from . import quantities
from .statistics import statistics_dtype


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_statistics(stats: list, reads: tuple = ()) -> None:
    """Sum ActivationStatistics over all ranks, in place. ``reads`` (the damping rule's, dopr/quantities.py): the
    per-layer quantities that travel too (summed, or by max in a second all-reduce; a missing one's stand-in),
    back as 0-d device tensors."""
    if not stats or not is_distributed():
        return
    like = stats[0].sums[0]
    counts = torch.tensor([float(st.count) for st in stats], dtype=like.dtype, device=like.device)
    parts = [s.flatten() for st in stats for s in st.sums] + [counts]
    summed = [n for n in reads if quantities.quantity(n).merge == "sum"]
    maxed = [n for n in reads if quantities.quantity(n).merge == "max"]

    def stacked(name):
        return torch.stack([st.extras[name].to(counts.dtype) if name in st.extras
                            else torch.as_tensor(quantities.stand_in(name, counts[i]), dtype=counts.dtype)
                            for i, st in enumerate(stats)])
    parts += [stacked(n) for n in summed]
    flat = torch.cat(parts)
    dist.all_reduce(flat)
    highest = torch.stack([stacked(n) for n in maxed]) if maxed else None
    if highest is not None:
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    offset = 0
    for st in stats:
        sums = []
        for s in st.sums:
            sums.append(flat[offset:offset + s.numel()].view_as(s).to(s.dtype))
            offset += s.numel()
        st.sums = tuple(sums)
    for st, count in zip(stats, flat[offset:offset + len(stats)].tolist()):   # one read-back for every count
        st.count = float(count)
    offset += len(stats)
    values = [(n, flat[offset + k * len(stats):offset + (k + 1) * len(stats)]) for k, n in enumerate(summed)]
    values += [(n, highest[k]) for k, n in enumerate(maxed)]
    if values:
        for i, st in enumerate(stats):
            st.extras = {**st.extras, **{n: v[i] for n, v in values}}


def nonfinite_keys(tensors: dict, across_ranks: bool) -> set:
    """The keys whose tensor has a non-finite entry, one device sync for all. With `across_ranks` (FSDP2: other
    rows of the same gradients) a key bad on any rank is bad on every rank."""
    if not tensors:
        return set()
    # one pass per tensor: a sum is finite unless an entry is non-finite (or it overflows, which the
    # exact per-tensor check below then clears)
    sums = torch.stack([t.sum() for t in tensors.values()])
    across_ranks = across_ranks and is_distributed()
    if across_ranks:
        dist.all_reduce(sums)
    if bool(sums.isfinite().all()):
        return set()
    bad = {k for k, t in tensors.items() if not bool(torch.isfinite(t).all())}
    if across_ranks:
        flags = torch.tensor([float(k in bad) for k in tensors], device=sums.device)
        dist.all_reduce(flags)
        bad = {k for k, f in zip(tensors, flags.tolist()) if f > 0}
    return bad


def agree_groups(groups: "OrderedDict", layers: list, statistic: type) -> "OrderedDict":
    """The groups {member names: statistics} every rank uses this step, from this rank's ``groups`` and the
    preconditioned ``layers`` (same order on every rank). The ranks take the maximum of each layer's leader (its
    group's first member) and of its negation: where the two agree, every rank that ran it grouped it alike; else
    it stands alone. A layer no rank ran is left out; a rank that did not run a group sends zeros, count 0."""
    if not is_distributed():
        return groups
    names = [l.helper.name for l in layers]
    index = {n: i for i, n in enumerate(names)}
    local = {}                                   # layer index -> (local group key, its statistics)
    leader = torch.full((len(names),), -1.0, dtype=torch.float64)
    for key, stat in groups.items():
        first = min(index[n] for n in key)
        for n in key:
            leader[index[n]] = first
            local[index[n]] = (key, stat)
    absent = float(-2 * len(names) - 2)
    device = next((s.sums[0].device for s in groups.values()), None)
    if device is None:
        device = layers[0].helper.module.weight.device
    both = torch.cat([leader, torch.where(leader >= 0, -leader, torch.full_like(leader, absent))]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    hi, lo = both[:len(names)].tolist(), (-both[len(names):]).tolist()
    members = OrderedDict()
    for i in range(len(names)):
        if hi[i] < 0:
            continue                              # no rank ran it
        lead = int(hi[i]) if hi[i] == lo[i] else i
        members.setdefault(lead, []).append(i)
    out, used = OrderedDict(), set()
    for lead, idx in members.items():
        key = tuple(names[i] for i in idx)
        mine = next((local[i] for i in idx if i in local), None)
        if mine is None:                          # this rank ran none of them: zeros, count 0
            helper = layers[lead].helper
            kind = helper.statistic_type(statistic)
            dtype = statistics_dtype(helper.module.weight.dtype)
            zeros = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in kind.sum_shapes(helper.dim))
            out[key] = kind(zeros, 0.0)
            continue
        stat = mine[1]
        out[key] = stat.clone() if id(stat) in used else stat
        used.add(id(stat))
    return out
