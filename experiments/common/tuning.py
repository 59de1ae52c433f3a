"""The tuning protocol every CPU analogue follows, so that DoPr and its gradient preconditioner (GP)
get the same budget and no reported seed took part in the choice.

1. Tune: per task, one sweep per arm over the SAME number of settings on the tuning seeds (the GP's
   grid may span learning rate x weight decay where DoPr's spans learning rate x damping or EMA).
2. Refine (`refinement`, the protocol's refine stage): one round, the same rule for every arm. A coarse winner
   whose neighbour on a refined axis (default the learning rate) is more than `refine_above` (3.5) times away
   gets the geometric midpoint of that gap, run on the tuning seeds with its other winning values fixed. A
   half-decade grid (1, 3, 10) is fine, a decade step (10x) coarse; an edge winner is the edge rule's; a gap to
   a non-positive value (weight decay 0) has no geometric midpoint. Budgets compare the tune grids; the points
   are counted apart and listed.
3. Select (`select`): per arm, the setting with the best mean of the task's validation metric
   (`task.tuning.metric`, `task.tuning.mode`) over the tuning seeds; a non-finite value is the worst.
   The refine runs count among the settings; a refinement due and not run is refused (naming the refine
   stage) unless `--skip-refine "<reason>"` records why. Refused too when a GP and its DoPr variant had
   unequal tune grids (trial counts), a setting is missing a seed, or
   a winner sits at the edge of a numeric axis (the smallest or largest value swept; with two values
   every winner does) unless `--accept-edge "<reason>"` records why. An axis of unordered values
   (a solver, a damping mode) has no edge: no value lies beyond it to widen towards. The fresh-seed
   list is fixed here, before any fresh run (`--seeds`, else the protocol sweep's `seed`).
   Writes selection.json / selection.md (seeds, grid, every trial, each arm's winner, the edges and
   the DoPr knobs the grid held fixed) and one tuned config per arm, plus `dopr_<gp>_at_gp_setting`:
   DoPr at the GP's whole winning setting (every key where the GP's winner differs from DoPr's:
   rate, weight decay, betas, momentum, schedule ...) with DoPr's own knobs (`ap.*`) at DoPr's
   winner, the paper's guideline ("swap the optimizer to DoPr, maintaining the same learning rate").
   Its old name `_at_gp_lr` (the rate alone) is refused by run.py.
4. Re-run the winners on the fixed fresh seeds (at least 3; 5 where a job is under 5 minutes):
   `python run.py -m "+tuned/<group>=glob(*)" seed=<fresh seeds>` (the protocol stage of
   `python -m experiments.common.protocol`, which runs each stage from conf/protocol/<task>.yaml; the
   at-GP config is not written when DoPr's winner already runs at the GP's setting).
5. Report (`report`): per arm, per-seed min / median / max and mean +- standard error of the task's
   metrics on the fixed fresh seeds, and a verdict line per pair naming the DoPr knobs held fixed;
   refused if a fresh seed was also a tuning seed. Seeds beyond the fixed list give a second table
   (protocol_all_seeds.*) titled so; a fixed seed that has not run leaves its row flagged
   (`missing`) and its pair without a verdict. protocol_runs.csv lists each run those tables count (arm,
   setting, seed, `fixed`: one of the fixed fresh seeds or not, the metrics, wall time, revision).

    python -m experiments.common.tuning select multirun/<tune gp> multirun/<tune dopr> \
        [--refined multirun/<refine gp> ...] --configs conf/tuned/<group> --out results/<task>/protocol
    python -m experiments.common.tuning report multirun/<fresh> \
        --selection results/<task>/protocol/selection.json --out results/<task>/protocol
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import yaml
from omegaconf import OmegaConf

from dopr.options import DoPrOptions

from .arms import AT_GP_SETTING, Arm
from .optim import optim_name
from .presets import refuse_hand_written
from .report import load_records, make_stamp, write_table

# overrides that say where or how a job ran, not what it trained: never part of a setting
_NOT_A_SETTING = ("seed", "sweep", "launcher", "skip_finished", "resume", "hydra.", "logger", "device", "threads")


def parse_override(override: str) -> tuple:
    key, _, value = override.partition("=")
    return key, value


def _is_setting(key: str) -> bool:
    bare = key.lstrip("+~")
    return not any(bare == k or bare.startswith(k) for k in _NOT_A_SETTING)


def parse_value(text: str):
    """An override's value as Hydra reads it: a number, else YAML (lists, booleans, null), else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def same_value(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return str(a) == str(b)


def _arm_jobs(records: list) -> dict:
    """{arm (summary['optim']): [(settings dict, seed, summary)]}, the settings being the job's
    command-line overrides that are neither its seed nor where it ran."""
    arms: dict = {}
    for r in records:
        s = r["summary"]
        over = dict(parse_override(o) for o in s.get("overrides", []) if _is_setting(parse_override(o)[0]))
        arms.setdefault(s["optim"], []).append((over, s["seed"], s))
    return arms


def _score(value, mode: str) -> float:
    v = float(value) if value is not None else float("nan")
    if not math.isfinite(v):
        return math.inf
    return v if mode == "min" else -v


#: DoPr's own knobs a tune grid may sweep or hold fixed: the `ap` group, every field of the library's DoPrOptions
DOPR_KNOBS = tuple(f"ap.{name}" for name in DoPrOptions.names())
_KNOB_DEFAULTS = {f"ap.{name}": value for name, value in DoPrOptions().as_dict().items()}
#: the verdict's words for a knob whose option name is not them (the rest: the name, "_" read as " ")
_KNOB_WORDS = {"ap.precond_ema": "statistics EMA", "ap.grad_ema": "gradient EMA", "ap.weak_share_bound": "weak-share bound",
               "ap.health_every": "health report interval", "ap.weak_share_estimate": "weak-share estimate"}
#: the knobs every verdict names, recorded or not; the others only where they differ from the library's default
_ALWAYS_NAMED = ("ap.damping", "ap.damping_mode", "ap.precond_ema", "ap.grad_ema")


def knob_words(knob: str) -> str:
    return _KNOB_WORDS.get(knob, knob.split(".", 1)[1].replace("_", " "))


def _at_default(knob: str, value) -> bool:
    value = tuple(value) if isinstance(value, list) else parse_value(value) if isinstance(value, str) else value
    default = _KNOB_DEFAULTS[knob]
    return value == default or (isinstance(default, str) and str(value) == default)
#: the suffix of DoPr's config at the GP's whole winning setting (it was `_at_gp_lr`: the rate alone)
AT_GP = f"_{AT_GP_SETTING}"
# resolved-config keys that differ between two arms without being part of what they trained
_NOT_COPIED = ("sweep_name", "optim.name", "optim.gp", "optim.ap", "ap.")   # the optimizer's identity stays DoPr's


def grid_edges(grid: dict, winner: dict) -> tuple:
    """([{axis, value, side, grid}], [unordered axes]): the axes on which the winner is the smallest or
    largest value swept. Only numeric axes have edges (with two values, every winner is at one); an
    axis of unordered values (a solver, a damping mode) has nothing beyond its values to widen to."""
    edges, unordered = [], []
    for axis, values in grid.items():
        parsed = [parse_value(v) for v in values]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parsed):
            unordered.append(axis)
            continue
        side = {values[0]: "smallest", values[-1]: "largest"}.get(winner.get(axis))
        if side:
            edges.append({"axis": axis, "value": winner[axis], "side": side, "grid": list(values)})
    return edges, unordered


def describe_edges(edges: list) -> str:
    return "; ".join(f"{e['arm']} {e['axis'].lstrip('+')}={e['value']} (the {e['side']} of "
                     f"{{{', '.join(e['grid'])}}})" for e in edges)


#: the refinement rule's defaults (a preset's `select: {refine_axes: [...], refine_above: ...}` changes them): the
#: axes it refines, and the step (a ratio) beyond which the grid counts as coarse around a winner. A half-decade
#: grid (1, 3, 10: steps of 3x and 3.33x) is fine; a decade step (10x) is coarse.
REFINE_AXES = ("optim.lr",)
REFINE_ABOVE = 3.5


def _positive(text):
    """An axis value as a positive number, else None (0, a negative, a word: no geometric midpoint)."""
    v = parse_value(text)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def refine_steps(axis: str, values: list, winner: str, above: float = REFINE_ABOVE) -> tuple:
    """([{axis, value, neighbour, gap, point}], note): the refinement one axis is due around its winner. Each
    neighbour of the winner in the ordered grid `values` (either side) more than `above` times away gives the
    geometric midpoint sqrt(w * n) of that gap; a winner at the grid's edge gives none (the edge rule's), and so
    does a gap to a non-positive value (weight decay 0). `note` says why a winner needs none."""
    i = next(i for i, v in enumerate(values) if same_value(parse_value(v), parse_value(winner)))
    if i in (0, len(values) - 1):
        return [], f"{axis.lstrip('+')}={winner} at the grid's edge (the edge rule's, nothing beyond the grid)"
    w, steps, within = _positive(winner), [], []
    if w is None:
        return [], f"{axis.lstrip('+')}={winner}: not a positive number, no geometric midpoint"
    for n in (values[i - 1], values[i + 1]):
        if _positive(n) is None:
            within.append(f"{n} not positive, no geometric midpoint")
            continue
        gap = max(w / _positive(n), _positive(n) / w)
        if gap > above:
            steps.append({"axis": axis, "value": winner, "neighbour": n, "gap": gap,
                          "point": override_text(math.sqrt(w * _positive(n)))})
        else:
            within.append(f"{n} {gap:.3g}x")
    return steps, f"{axis.lstrip('+')}={winner}: nearest neighbours within {above:g}x ({', '.join(within)})"


def refinement(arms: dict, axes=REFINE_AXES, above: float = REFINE_ABOVE) -> dict:
    """{arm: {coarse_winner, steps, points, note}}: the one refinement round each arm's coarse winner is due (the
    same rule for every arm). On each axis of `axes` the arm swept, `refine_steps` gives the midpoints; a point is
    the coarse winner with that axis at one midpoint, the arm's other winning values fixed. `points` is empty
    where none is due, and `note` says why. One round: the points are not refined again."""
    out = {}
    for arm, a in arms.items():
        steps, notes = [], []
        for axis in (k for k in a["grid"] if k.lstrip("+") in axes):
            more, note = refine_steps(axis, a["grid"][axis], a["winner"][axis], above)
            steps += more
            notes += [] if more else [note]
        out[arm] = {"coarse_winner": a["winner"], "steps": steps,
                    "points": [{**a["winner"], st["axis"]: st["point"]} for st in steps],
                    "note": "; ".join(notes) or ("" if steps else f"no axis of {', '.join(axes)} swept")}
    return out


def resolved_setting(cfg) -> dict:
    """A job's resolved config as {dotted key: value}, without what only says where or how it ran."""
    if cfg is None:
        return None
    flat = {}

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
            else:
                flat[key] = v
    tree = OmegaConf.to_container(cfg, resolve=False) if not isinstance(cfg, dict) else cfg
    walk({k: v for k, v in tree.items() if _is_setting(k)}, "")
    return flat


def tune_arms(records: list, metric: str, mode: str = "min") -> dict:
    """{arm: its tuning record}: per arm (summary['optim']) the settings it ran on the tuning seeds, each
    setting's mean of `metric`, the winner, the grid and its edges (see `_tune_arm`)."""
    return {arm: _tune_arm(arm, jobs, records, metric, mode) for arm, jobs in sorted(_arm_jobs(records).items())}


def _tune_arm(arm: str, jobs: list, records: list, metric: str, mode: str) -> dict:
    """One arm's tuning record from its jobs [(settings, seed, summary)]: base (the keys every job set alike),
    grid (the swept axes' values, ordered), seeds, trials (per setting the mean over the seeds, best first),
    winner, its value and edges, and the winner's resolved config (from `records`). Refused when a setting
    lacks a seed the others ran."""
    keys = sorted({k for over, _, _ in jobs for k in over})
    varying = [k for k in keys if len({over.get(k) for over, _, _ in jobs}) > 1]
    base = {k: jobs[0][0][k] for k in keys if k not in varying}
    trials: dict = {}
    for over, seed, s in jobs:
        if metric not in s:
            raise ValueError(f"{arm}: summary.json of seed {seed} has no {metric!r} (has {sorted(s)[:12]}...)")
        trials.setdefault(tuple(over.get(k) for k in varying), {})[seed] = s[metric]
    seeds = sorted({seed for _, seed, _ in jobs})
    for setting, by_seed in trials.items():
        if sorted(by_seed) != seeds:
            raise ValueError(f"{arm}: setting {dict(zip(varying, setting))} ran seeds {sorted(by_seed)}, the "
                             f"others {seeds}: finish the tuning sweep (skip_finished=true) before selecting")
    rows = [{"setting": dict(zip(varying, setting)), "value": float(np.mean([float(v) for v in by_seed.values()])),
             "per_seed": {str(k): float(v) for k, v in sorted(by_seed.items())}} for setting, by_seed in trials.items()]
    rows.sort(key=lambda t: _score(t["value"], mode))
    order = lambda v: (float(parse_value(v)) if isinstance(parse_value(v), (int, float)) else math.inf, str(v))
    grid = {k: sorted({over[k] for over, _, _ in jobs if k in over}, key=order) for k in varying}
    winner = rows[0]["setting"]
    edges, unordered = grid_edges(grid, winner)
    cfg = next((r["config"] for r in records if r["summary"]["optim"] == arm and r.get("config") is not None
                and {k: v for k, v in _arm_jobs([r])[arm][0][0].items() if k in varying} == winner), None)
    return {"base": base, "grid": grid, "seeds": seeds, "trials": rows, "winner": winner, "value": rows[0]["value"],
            "at_grid_edge": edges, "unordered_axes": unordered, "resolved": resolved_setting(cfg)}


def describe_steps(steps: list) -> str:
    """'optim.lr=0.01 (its neighbour 0.001 10x away) -> 0.00316'."""
    return "; ".join(f"{st['axis'].lstrip('+')}={st['value']} (its neighbour {st['neighbour']} {st['gap']:.3g}x away) -> "
                     f"{float(st['point']):.3g}" for st in steps)


_REFINE_COMMAND = "python -m experiments.common.protocol refine <task> [--variant V]"


def refine_arms(arms: dict, records: list, refined: list, metric: str, mode: str = "min", axes=REFINE_AXES,
                above: float = REFINE_ABOVE, skip: str = None, command: str = None) -> dict:
    """The arms with their refinement round (`refinement`) taken in from the refine runs `refined`: a due arm's
    winner is the best of its grid and its points, its trials the points too (marked `refinement`), its
    `refinement` the coarse winner, the gaps, the points and the final winner; an arm none is due records why.
    Refused when a due point has not run on every tuning seed, naming the refine stage's `command`, unless `skip`
    gives the reason (recorded); refused too when a refine run is at a setting the rule does not ask for."""
    if skip is not None and not skip.strip():
        raise ValueError("--skip-refine needs the reason the refinement is skipped, recorded in selection.json/.md")
    due, by_arm = refinement(arms, axes, above), _arm_jobs(refined)
    stray = sorted(set(by_arm) - set(arms))
    if stray:
        raise ValueError(f"refine runs of {', '.join(stray)}, which has no tuning runs here")
    out, missing = {}, []
    for arm, a in arms.items():
        found, lacking, unasked = _refine_jobs(a, by_arm.get(arm, []), due[arm]["points"])
        if unasked:
            raise ValueError(f"{arm}: a refine run at {_fmt(unasked[0])}, which the refinement of its coarse winner "
                             f"{_fmt(a['winner'])} does not ask for ({describe_steps(due[arm]['steps']) or 'none due'}): "
                             "remove those runs (a refinement of an earlier winner?) and run the refine stage again")
        if lacking and skip is None:
            missing.append(f"{arm} {describe_steps(due[arm]['steps'])} on seeds {a['seeds']}")
            continue
        out[arm] = _refined_arm(arm, a, due[arm], [] if lacking else found, records, refined, metric, mode, skip)
    if missing:
        raise ValueError(f"a refinement is due and has not run: {'; '.join(missing)} (winners with a neighbour beyond "
                         f"{above:g}x). Run it: {command or _REFINE_COMMAND}"
                         ", then select again; or pass --skip-refine \"<reason>\" (recorded in selection.json and "
                         "selection.md)")
    return out


def _refine_jobs(arm: dict, jobs: list, points: list) -> tuple:
    """(jobs at the points, as (the point's settings, seed, summary); the points some tuning seed has not run;
    [the settings of runs at no point or on another seed])."""
    keys = set(arm["base"]) | set(arm["grid"])
    at = lambda over, p: set(over) == keys and all(same_value(parse_value(over[k]), parse_value(v))
                                                   for k, v in {**arm["base"], **p}.items())
    found, unasked, ran = [], [], {}
    for over, seed, s in jobs:
        i = next((i for i, p in enumerate(points) if at(over, p)), None)
        if i is None or seed not in arm["seeds"]:
            unasked.append({**{k: v for k, v in over.items() if arm["base"].get(k) != v}, "seed": seed})
            continue
        found.append(({**arm["base"], **points[i]}, seed, s))
        ran.setdefault(i, set()).add(seed)
    return found, [p for i, p in enumerate(points) if ran.get(i) != set(arm["seeds"])], unasked


def _refined_arm(arm: str, a: dict, due: dict, found: list, records: list, refined: list, metric: str, mode: str,
                 skip: str) -> dict:
    """One arm's tuning record with its refinement round: its grid, edges and budget those of the tune."""
    record = {"coarse_winner": a["winner"], "coarse_value": a["value"], "steps": due["steps"], "points": due["points"],
              "note": due["note"]}
    if not due["points"] or not found:
        return {**a, "refinement": {**record, **({"skipped": skip} if due["points"] else {})}}
    full = _tune_arm(arm, _arm_jobs(records)[arm] + found, records + refined, metric, mode)
    edges, unordered = grid_edges(a["grid"], full["winner"])
    trials = [{**t, "refinement": True} if any(_same_settings(t["setting"], p) for p in due["points"]) else t
              for t in full["trials"]]
    return {**full, "grid": a["grid"], "trials": trials, "at_grid_edge": edges, "unordered_axes": unordered,
            "refinement": {**record, "winner": full["winner"], "value": full["value"]}}


def budget(arm: dict) -> int:
    """The settings an arm's tune grid ran (its refinement points, by the same rule for every arm, counted apart)."""
    return sum(1 for t in arm["trials"] if not t.get("refinement"))


def select(records: list, metric: str, mode: str = "min", allow_unequal: bool = False,
           accept_edge: str = None, fresh_seeds: list = None, gp_from: tuple = None, refined: list = None,
           refine_axes=REFINE_AXES, refine_above: float = REFINE_ABOVE, skip_refine: str = None,
           refine_command: str = None) -> dict:
    """Each arm's best setting on the tuning seeds (see the module doc). Refused when a winner sits at
    the edge of a numeric axis unless accept_edge gives the reason, which the selection records.

    refined: the refine stage's runs (`refine_arms`: each arm's coarse winner refined by one rule, its points
    counted apart from the tune grid's budget); a refinement due and not run is refused unless skip_refine
    gives the reason.

    gp_from: (path, selection) of an earlier selection whose GP arms stand in for GPs the records lack
    (a DoPr rule tuned later against a GP whose code path has not changed): same metric, mode and tuning
    seeds, or refused; each such arm records the file it came from."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if accept_edge is not None and not accept_edge.strip():
        raise ValueError("--accept-edge needs the reason the edge is accepted, recorded in selection.json/.md")
    arms = refine_arms(tune_arms(records, metric, mode), records, refined or [], metric, mode, refine_axes,
                       refine_above, skip_refine, refine_command)
    if gp_from is not None:
        arms.update(_earlier_gps(arms, metric, mode, *gp_from))
    records = {name: Arm.read(name) for name in arms}
    pairs = [(arm.but(ap=False).name, name) for name, arm in records.items() if arm.ap and arm.but(ap=False).name in arms]
    if not pairs:
        raise ValueError(f"no GP with its DoPr variant among the arms {sorted(arms)}: nothing to compare")
    for gp, dopr in pairs:
        n_gp, n_dopr = budget(arms[gp]), budget(arms[dopr])
        if n_gp != n_dopr and not allow_unequal:
            raise ValueError(f"unequal tuning budgets: {gp} had {n_gp} settings, {dopr} {n_dopr}; the protocol gives "
                             "both arms the same number (or pass --allow-unequal and say so in the results)")
    for arm, a in arms.items():
        if records[arm].ap:
            a["dopr_knobs_fixed"], a["dopr_knobs_tuned"] = dopr_knobs(a)
    seeds = sorted({s for a in arms.values() for s in a["seeds"]})
    edges = [{"arm": arm, **e} for arm, a in arms.items() for e in a["at_grid_edge"]]
    if edges and accept_edge is None:
        raise ValueError(f"winners at the edge of their grid: {describe_edges(edges)}. Widen those axes (both arms "
                         "of a pair alike) and re-run the tuning sweeps, or pass --accept-edge \"<reason>\" (recorded "
                         "in selection.json and selection.md)")
    if fresh_seeds is not None:
        fresh_seeds = sorted(int(s) for s in fresh_seeds)
        if set(fresh_seeds) & set(seeds):
            raise ValueError(f"fresh seeds {sorted(set(fresh_seeds) & set(seeds))} are tuning seeds {seeds}: the "
                             "protocol re-runs the winners on seeds the selection never saw")
    skipped = any(a.get("refinement", {}).get("skipped") for a in arms.values())
    return {"metric": metric, "mode": mode, "seeds": seeds, "fresh_seeds": fresh_seeds, "arms": arms, "pairs": pairs,
            "accept_edge": {"reason": accept_edge, "edges": edges} if edges else None,
            "refine": {"axes": list(refine_axes), "above": refine_above, "skipped": skip_refine if skipped else None}}


def _earlier_gps(arms: dict, metric: str, mode: str, path: str, earlier: dict) -> dict:
    """The GP arms of an earlier selection (`path`) that the DoPr arms here need and the records lack."""
    if (earlier.get("metric"), earlier.get("mode")) != (metric, mode):
        raise ValueError(f"{path} selected by {earlier.get('metric')!r} ({earlier.get('mode')}), this selection by "
                         f"{metric!r} ({mode}): the GP's winner must be chosen by the same measure")
    out = {}
    for dopr in (a for a in arms if Arm.read(a).ap):
        gp = Arm.read(dopr).but(ap=False).name
        if gp in arms:
            raise ValueError(f"{gp} is both in the tuning sweeps and taken from {path}: pass one")
        if gp not in earlier.get("arms", {}):
            continue
        if earlier["arms"][gp]["seeds"] != arms[dopr]["seeds"]:
            raise ValueError(f"{gp} in {path} was tuned on seeds {earlier['arms'][gp]['seeds']}, {dopr} here on "
                             f"{arms[dopr]['seeds']}: the protocol tunes both arms on the same seeds")
        out[gp] = {**earlier["arms"][gp], "from_selection": str(path)}
    return out


def dopr_knobs(arm: dict) -> tuple:
    """({knob: value} DoPr's own knobs the arm's tune grid held fixed, [the knobs it swept]). The values
    come from the winner's resolved config, else its command line; None where neither says."""
    swept = {k.lstrip("+~") for k in arm["grid"]}
    given = {k.lstrip("+~"): parse_value(v) for k, v in arm["base"].items()}
    resolved = arm.get("resolved") or {}
    fixed = {k: resolved.get(k, given.get(k)) for k in DOPR_KNOBS if k not in swept}
    # a knob neither the config nor the command line records (an older config; None, the default, of an optional
    # one) is left out, save those every verdict names
    fixed = {k: v for k, v in fixed.items() if v is not None or k in _ALWAYS_NAMED}
    if "ap.weak_share_bound" not in fixed:   # the report's interval and the share's estimate: knobs of that rule only
        fixed.pop("ap.health_every", None)
        fixed.pop("ap.weak_share_estimate", None)
    return fixed, [k for k in DOPR_KNOBS if k in swept]


def describe_knobs(arm: dict) -> str:
    """'DoPr's damping 0.001 (trace), statistics EMA 0 (none) and gradient EMA 0 (none) held fixed'."""
    if "dopr_knobs_fixed" not in arm:
        return "DoPr's own knobs: not recorded (selection made before they were)"
    # read again from the winner's resolved config where the selection kept it: the record may predate a knob
    # (selections before issue 74 left out the damping rule and named a sample-count run "damping 0.0 (trace)")
    fixed = dict(dopr_knobs(arm)[0] if arm.get("resolved") and "grid" in arm else arm["dopr_knobs_fixed"])
    say = lambda k, v: "(value not recorded)" if v is None else (f"{v} (none)" if "ema" in k and v == 0 else f"{v}")
    parts = []
    solver = fixed.pop("ap.solver", None)
    cap = fixed.pop("ap.span_cap", None)
    if solver == "span":   # no damping: its damping keys are not read (dopr/solvers.py)
        fixed.pop("ap.damping", None), fixed.pop("ap.damping_mode", None)
        parts.append(f"solver span (no damping), span cap {say('ap.span_cap', cap)}")
    elif solver not in (None, "cholesky"):
        parts.append(f"solver {solver}")
    bound, every = fixed.pop("ap.weak_share_bound", None), fixed.pop("ap.health_every", None)
    estimate = fixed.pop("ap.weak_share_estimate", None)
    if bound is not None and estimate == "filter":   # chosen every refresh, whatever the report's interval
        mode = fixed.pop("ap.damping_mode", None)
        parts.append(f"damping set by the weak share's Cholesky filter (weak share <= {bound}, every refresh, "
                     f"floor {say('ap.damping', fixed.pop('ap.damping', None))}" + (f" ({mode}))" if mode else ")"))
    elif bound is not None:   # the damping is only the floor the health report raises (dopr/health.py)
        mode = fixed.pop("ap.damping_mode", None)
        parts.append(f"damping set by the health report (weak share <= {bound}, every {say('', every)} steps, "
                     f"floor {say('ap.damping', fixed.pop('ap.damping', None))}" + (f" ({mode}))" if mode else ")"))
    rule = fixed.pop("ap.damping_rule", "trace")
    if rule != "trace":   # lambda from the rule, the damping its floor (dopr/damping.py)
        mode = fixed.pop("ap.damping_mode", None)
        parts.append(f"damping rule {rule} (floor {say('ap.damping', fixed.pop('ap.damping', None))}"
                     + (f" ({mode}))" if mode else ")"))
    if "ap.damping" in fixed:
        mode = fixed.pop("ap.damping_mode", None)
        parts.append(f"damping {say('ap.damping', fixed.pop('ap.damping'))}" + (f" ({mode})" if mode else ""))
    order = [k for k in _ALWAYS_NAMED if k in fixed] + [k for k in fixed if k not in _ALWAYS_NAMED]
    parts += [f"{knob_words(k)} {say(k, fixed[k])}" for k in order
              if k in _ALWAYS_NAMED or fixed[k] is None or not _at_default(k, fixed[k])]
    tuned = [knob_words(k) for k in arm.get("dopr_knobs_tuned", [])]
    text = ("DoPr's " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])
            + " held fixed, not tuned") if parts else "none of DoPr's own knobs held fixed"
    return text + (f" ({', '.join(tuned)} tuned)" if tuned else "")


def _lr_key(settings: dict):
    return next((k for k in settings if k.lstrip("+") == "optim.lr"), None)


def override_text(value) -> str:
    """A resolved config value as an override's text (what parse_value reads back)."""
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def gp_setting_for_dopr(selection: dict, gp: str, dopr: str) -> tuple:
    """(overrides, copied): DoPr's variant at the GP's whole winning setting. It starts from DoPr's
    winner (its arm choice and its own knobs, `ap.*`), then takes every key of the GP's winner: the
    keys the GP swept or set on its command line, and, where both tuning jobs left a resolved config,
    every key whose resolved value differs between the two winners (weight decay, betas, momentum,
    schedule ... a tuned file set). `copied` lists the GP keys that changed DoPr's setting."""
    g, d = selection["arms"][gp], selection["arms"][dopr]
    out = {**d["base"], **d["winner"]}
    bare = {k.lstrip("+~"): k for k in out}
    copied = {}

    def put(key, value):
        k = key.lstrip("+~")
        if k.startswith("ap.") or k == "ap":
            return  # DoPr's own knobs stay at DoPr's winner
        old = bare.get(k)
        if old is not None and same_value(parse_value(str(out[old])), parse_value(str(value))):
            return
        if old is not None:
            del out[old]
        out[old or key] = value
        bare[k] = old or key
        copied[k] = value
    for key, value in {**g["base"], **g["winner"]}.items():
        if value != gp:  # not the GP's own arm choice (+tuned/<group>=<gp>, optim=<gp>)
            put(key, value)
    if g.get("resolved") is not None and d.get("resolved") is not None:
        for key, value in g["resolved"].items():
            if key.startswith(_NOT_COPIED) or key == "ap":
                continue
            if key not in d["resolved"] or not same_value(value, d["resolved"][key]):
                put(key, override_text(value))
    return out, copied


def chosen_settings(selection: dict) -> dict:
    """{name: overrides} to re-run on fresh seeds: each arm's winner (on its base) and, per pair,
    DoPr at the GP's whole winning setting (`<dopr>_at_gp_setting`)."""
    out = {arm: {**a["base"], **a["winner"]} for arm, a in selection["arms"].items()}
    for gp, dopr in selection["pairs"]:
        out[f"{dopr}{AT_GP}"] = gp_setting_for_dopr(selection, gp, dopr)[0]
    return out


def arm_of(name: str) -> str:
    """The name of the runs a chosen setting's name re-uses: "dopr_adamw" for "dopr_adamw_at_gp_setting"."""
    return Arm.read(name).optim


def tuned_config(overrides: dict, note: str) -> str:
    """A `+tuned/<group>=<name>` config file holding these overrides: group choices in its defaults
    list (`+tuned/x=y` becomes `/tuned/x@_global_: y`, `optim=y` an override), values as YAML."""
    defaults, values = [], OmegaConf.create()
    for key, value in overrides.items():
        bare = key.lstrip("+~")
        if "/" in bare:
            defaults.append(f"  - /{bare}@_global_: {value}")
        elif bare in ("optim", "task", "model"):
            defaults.append(f"  - override /{bare}: {value}")
        else:
            OmegaConf.update(values, bare, parse_value(value), force_add=True)
    lines = ["# @package _global_", *(f"# {l}" for l in note.splitlines())]
    if defaults:
        lines += ["defaults:", *defaults]
    if values:
        lines.append(OmegaConf.to_yaml(values).rstrip())
    return "\n".join(lines) + "\n"


def _fmt(settings: dict) -> str:
    return ", ".join(f"{k.lstrip('+')}={v}" for k, v in settings.items()) or "(no knob varied)"


def selection_notes(selection: dict) -> list:
    """The lines selection.md carries under its table: the fixed fresh seeds, the edges (and the reason
    they were accepted), the unordered axes, the DoPr knobs each DoPr arm held fixed, the at-GP copies."""
    fresh = selection.get("fresh_seeds")
    lines = ["", f"Fresh seeds fixed for the protocol: {fresh}" + (f" (from {selection['fresh_seeds_from']})"
                                                                      if selection.get("fresh_seeds_from") else "")
             if fresh else "Fresh seeds: not fixed by this selection"]
    acc = selection.get("accept_edge")
    if acc:
        lines.append(f"Winners at the edge of their grid, accepted with --accept-edge: {describe_edges(acc['edges'])}. "
                     f"Reason: {acc['reason']}")
    else:
        lines.append("No winner at the edge of a numeric axis.")
    for arm, a in selection["arms"].items():
        if a.get("from_selection"):
            lines.append(f"{arm}: its tuning trials and winner taken from {a['from_selection']} (not re-run here).")
        if a.get("unordered_axes"):
            lines.append(f"{arm}: {', '.join(k.lstrip('+') for k in a['unordered_axes'])} unordered (no edge to flag)")
    lines += [describe_refinement(arm, a, selection) for arm, a in selection["arms"].items()
              if "refinement" in a or a.get("from_selection")]
    for gp, dopr in selection["pairs"]:
        lines.append(f"{dopr}: {describe_knobs(selection['arms'][dopr])}.")
        _, copied = gp_setting_for_dopr(selection, gp, dopr)
        lines.append(f"{dopr}{AT_GP}: DoPr at {gp}'s whole winning setting, copying {_fmt(copied)}"
                     + ("" if selection["arms"][gp].get("resolved") is not None else
                        " (command-line keys only: the tuning jobs left no resolved config to compare)") + ".")
    return lines


def describe_refinement(arm: str, a: dict, selection: dict) -> str:
    """selection.md's line on an arm's refinement round: the coarse winner, the gaps, the points run and the
    final winner; or why none was due; or the reason it was skipped."""
    r, m = a.get("refinement"), selection["metric"]
    if r is None:
        return f"{arm}: no refinement recorded in {a['from_selection']} (selected before the refinement rule)."
    if not r["points"]:
        return f"{arm}: no refinement: {r['note']}."
    if r.get("skipped"):
        return f"{arm}: refinement skipped with --skip-refine (due: {describe_steps(r['steps'])}). Reason: {r['skipped']}"
    above = (selection.get("refine") or {}).get("above", REFINE_ABOVE)
    return (f"{arm}: refined around the coarse winner {_fmt(r['coarse_winner'])} ({m} {r['coarse_value']:.4g}), a gap "
            f"beyond {above:g}x: {describe_steps(r['steps'])}, run on seeds {a['seeds']}; final winner "
            f"{_fmt(r['winner'])} ({m} {r['value']:.4g}).")


def settings_count(arm: dict) -> str:
    extra = len(arm["trials"]) - budget(arm)
    return f"{budget(arm)} settings" + (f" + {extra} refinement" if extra else "")


def write_selection(selection: dict, out: Path, stamp: str, configs: Path = None, command: str = "") -> None:
    """selection.json / .md / .csv into `out`, and one preset per chosen setting into `configs` (a conf/tuned/<group>
    folder). A group that conf_handwritten/tuned/ has (hand-written presets) is refused before anything is written."""
    if configs is not None:
        refuse_hand_written(configs, list(chosen_settings(selection)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "selection.json").write_text(json.dumps(selection, indent=1) + "\n")
    edge_of = lambda a: ", ".join(f"{e['axis'].lstrip('+')} {e['side']}" for e in a["at_grid_edge"])
    rows = [{"arm": arm, "setting": _fmt(t["setting"]), selection["metric"]: t["value"],
             "per_seed": " ".join(f"{v:.4g}" for v in t["per_seed"].values()),
             "chosen": ("yes" + (f" (at the grid's edge: {edge_of(a)})" if a["at_grid_edge"] else ""))
             if t["setting"] == a["winner"] else "", "round": "refinement" if t.get("refinement") else "tune"}
            for arm, a in selection["arms"].items() for t in a["trials"]]
    grids = "; ".join(f"{arm}: " + " x ".join(f"{k.lstrip('+')} in {{{', '.join(v)}}}" for k, v in a["grid"].items())
                      + f" ({settings_count(a)})" for arm, a in selection["arms"].items())
    title = (f"Tuning: {selection['metric']} ({selection['mode']}, mean over tuning seeds "
             f"{selection['seeds']}) per setting. Grids: {grids}")
    write_table(rows, ["arm", "setting", selection["metric"], "per_seed", "chosen", "round"], out / "selection", stamp,
                title)
    md = out / "selection.md"
    md.write_text(md.read_text() + "\n".join(selection_notes(selection)) + "\n")
    if configs is not None:
        configs.mkdir(parents=True, exist_ok=True)
        chosen = chosen_settings(selection)
        for stale in configs.glob("*.yaml"):  # an earlier selection's files: the protocol sweep globs the folder
            if stale.stem not in chosen and "chosen by the tuning protocol" in stale.read_text():
                stale.unlink()
        for name, overrides in chosen.items():
            twin = arm_of(name)
            if name != twin and _same_settings(overrides, chosen[twin]):
                (configs / f"{name}.yaml").unlink(missing_ok=True)  # DoPr chose the GP's setting: nothing new to run
                continue
            note = (f"{name}: chosen by the tuning protocol (experiments/common/tuning.py) on seeds "
                    f"{selection['seeds']} by {selection['metric']} ({selection['mode']}); see {out / 'selection.md'}\n"
                    f"made by: {command}")
            if name != twin:
                gp = Arm.read(twin).but(ap=False).name
                note += (f"\nDoPr at {gp}'s whole winning setting (the paper's 'same learning rate' guideline), "
                         f"DoPr's own knobs at {twin}'s winner; copied from {gp}: "
                         f"{_fmt(gp_setting_for_dopr(selection, gp, twin)[1])}")
            if selection.get("accept_edge"):
                note += f"\nwritten with winners at a grid edge (--accept-edge): {selection['accept_edge']['reason']}"
            (configs / f"{name}.yaml").write_text(tuned_config(overrides, note))


def _same_settings(a: dict, b: dict) -> bool:
    norm = lambda d: {k.lstrip("+"): v for k, v in d.items()}
    a, b = norm(a), norm(b)
    return a.keys() == b.keys() and all(same_value(parse_value(a[k]), parse_value(b[k])) for k in a)


def matches_setting(record: dict, overrides: dict) -> bool:
    cfg = record["config"]
    for key, value in overrides.items():
        bare = key.lstrip("+~")
        if "/" in bare:
            continue  # a group choice: its values are checked through the keys below
        if bare == "optim":   # the optimizer's name, derived from its gp and ap (an older run's: its name)
            if optim_name(cfg.optim) != value:
                return False
        elif bare == "task":
            if str(OmegaConf.select(cfg, "task.name")) != value:
                return False
        elif not same_value(OmegaConf.select(cfg, bare), parse_value(value)):
            return False
    return True


def _fresh_runs(records: list, selection: dict, seeds: list = None) -> list:
    """[(name, overrides, runs)]: per chosen setting its fresh runs, one a seed (only the seeds in `seeds` when
    given), the runs that `report` aggregates and `run_rows` lists. Refused if a run is on a tuning seed."""
    tuning = set(selection["seeds"])
    reused = sorted({r["summary"]["seed"] for r in records} & tuning)
    if reused:
        raise ValueError(f"seeds {reused} were tuning seeds: report only fresh seeds (the protocol re-runs the "
                         "winners on seeds the selection never saw)")
    if seeds is not None:
        records = [r for r in records if r["summary"]["seed"] in set(seeds)]
    out = []
    for name, overrides in chosen_settings(selection).items():
        arm = arm_of(name)
        runs = {}  # one run per seed: when DoPr's winner is at the GP's setting, two names launch the same setting
        for r in sorted((r for r in records if r["summary"]["optim"] == arm and matches_setting(r, overrides)),
                        key=lambda r: not any(o.endswith(f"={name}") for o in r["summary"].get("overrides", []))):
            runs.setdefault(r["summary"]["seed"], r)
        out.append((name, overrides, list(runs.values())))
    return out


def _setting_text(overrides: dict) -> str:
    return _fmt({k: v for k, v in overrides.items() if "/" not in k})


def _run_value(run: dict, m: str, selection: dict) -> float:
    """A run's value of metric m as the report counts it: a run that diverged has no value of the selection
    metric and counts as the worst (+inf when lower is better), of another metric as NaN."""
    worst = (math.inf if selection["mode"] == "min" else -math.inf) if m == selection["metric"] else math.nan
    return worst if run["summary"][m] is None else float(run["summary"][m])


def report(records: list, selection: dict, metrics: list, seeds: list = None) -> list:
    """Rows of the fresh-seed results: per chosen setting, each metric's min / median / max and mean
    +- standard error over the seeds (only those in `seeds` when given; a row that lacks some of them
    lists them under `missing`)."""
    rows = []
    for name, overrides, runs in _fresh_runs(records, selection, seeds):
        row = {"arm": name, "setting": _setting_text(overrides),
               "seeds": " ".join(str(s) for s in sorted(r["summary"]["seed"] for r in runs))}
        missing = sorted(set(seeds or ()) - {r["summary"]["seed"] for r in runs})
        if missing:
            row["missing"] = " ".join(str(s) for s in missing)
        diverged = sum(1 for r in runs if r["summary"].get("diverged_at") is not None)
        if diverged:
            row["diverged"] = diverged
        for m in metrics:
            v = np.array([_run_value(r, m, selection) for r in runs if m in r["summary"]])
            if v.size:
                row.update({f"{m}_min": float(v.min()), f"{m}_median": float(np.median(v)), f"{m}_max": float(v.max()),
                            f"{m}_mean": float(v.mean()),
                            f"{m}_se": float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 and np.isfinite(v).all() else float("nan")})
        rows.append(row)
    return rows


#: protocol_runs.csv's columns beside the metrics: a run's seed, whether it is one of the fixed fresh seeds
RUN_COLUMNS = ("arm", "setting", "seed", "fixed")
RUN_EXTRAS = ("diverged_at", "wall_time_s", "git_revision")


def run_rows(records: list, selection: dict, metrics: list) -> list:
    """One row per fresh run the report counts (protocol_runs.csv), sorted by arm, then seed: its chosen
    setting's name and text as protocol.csv has them, its seed, `fixed` (true: one of the fresh seeds the
    selection fixed, the runs protocol.csv aggregates; false: a seed beyond them, in protocol_all_seeds.csv
    only), each metric as the report counts it (a diverged run's selection metric the worst) and the run's
    diverged_at, wall_time_s and git_revision where its summary has them."""
    fixed = set(selection.get("fresh_seeds") or ())
    rows = [{"arm": name, "setting": _setting_text(overrides), "seed": r["summary"]["seed"],
             "fixed": "true" if r["summary"]["seed"] in fixed else "false",
             **{m: _run_value(r, m, selection) for m in metrics if m in r["summary"]},
             **{k: r["summary"][k] for k in RUN_EXTRAS if r["summary"].get(k) is not None},
             **({"base": _base(r)} if _base(r) else {})}
            for name, overrides, runs in _fresh_runs(records, selection) for r in runs]
    return sorted(rows, key=lambda r: (r["arm"], r["seed"]))


def _base(record: dict) -> str:
    """The fine-tuned base a run started from (its summary's base.weights_sha256, experiments/llm/model.py), or ""."""
    return (record["summary"].get("base") or {}).get("weights_sha256", "")


def check_one_base(records: list) -> None:
    """Refuse a report over runs fine-tuned from different bases (their recorded weight hashes differ): the
    SFT analogue's verdict moved with the base, so such a table compares bases, not optimizers."""
    bases: dict = {}
    for r in records:
        if _base(r):
            bases.setdefault(_base(r), []).append(str(r.get("dir", "?")))
    if len(bases) > 1:
        raise ValueError("the runs were fine-tuned from different bases (summary.json base.weights_sha256): "
                         + "; ".join(f"{h}: {len(d)} run{'s' * (len(d) > 1)}, e.g. {d[0]}" for h, d in sorted(bases.items()))
                         + ". Report each base's runs apart, or re-run them from one base")


def protocol_tables(records: list, selection: dict, metrics: list) -> tuple:
    """(rows on the fixed fresh seeds, rows on every seed found or None, [seeds beyond the fixed list]).
    The fixed list is the one select recorded before any fresh run; seeds run later do not enter the
    protocol's table, they get a table of their own."""
    fixed = selection.get("fresh_seeds")
    if not fixed:
        raise ValueError("the selection fixes no fresh seeds (selection.json without 'fresh_seeds': made before "
                         "select recorded them); re-run select with --seeds <the list fixed before the fresh runs>")
    extra = sorted({r["summary"]["seed"] for r in records} - set(fixed))
    return report(records, selection, metrics, seeds=fixed), (report(records, selection, metrics) if extra else None), extra


def verdicts(rows: list, selection: dict) -> list:
    """One line per GP / DoPr pair: DoPr better or worse where the seeds' ranges do not overlap,
    inconclusive where they do, no verdict where a fixed seed is missing; each names the DoPr knobs
    the tuning held fixed."""
    by = {r["arm"]: r for r in rows}
    m, mode = selection["metric"], selection["mode"]
    lines = []
    for gp, dopr in selection["pairs"]:
        g, d, at = by.get(gp), by.get(dopr), by.get(f"{dopr}{AT_GP}")
        head = f"Verdict, {dopr} vs {gp} by {m} ({'lower' if mode == 'min' else 'higher'} is better)"
        knobs = describe_knobs(selection["arms"][dopr])
        missing = [f"{r['arm']} lacks seeds {r['missing']}" for r in (g, d, at) if r and r.get("missing")]
        if missing or f"{m}_median" not in (g or {}) or f"{m}_median" not in (d or {}):
            lines.append(f"{head}: no verdict, the table is partial ({'; '.join(missing) or 'no runs'}). {knobs}.")
            continue
        word = spread_word(d, g, m, mode, "DoPr")
        at_gp = f"; DoPr at {gp}'s setting {at[f'{m}_median']:.4g}" if at and f"{m}_median" in at else ""
        lines.append(f"{head}, seeds {d['seeds']}: {word}: median {d[f'{m}_median']:.4g} vs "
                     f"{g[f'{m}_median']:.4g}{at_gp}. {knobs}.")
    return lines


def spread_word(a: dict, b: dict, m: str, mode: str, name: str) -> str:
    """Arm row `a` against arm row `b` by metric `m`: better or worse where the seeds' ranges do not overlap,
    inconclusive where they do (`name` is what the words call arm `a`)."""
    word, ahead = spread_verdict(a, b, m, mode)
    if word != "inconclusive":
        return f"{name} {word}, no seed overlap"
    return f"inconclusive, the seeds overlap ({name} {'ahead' if ahead else 'behind'} on the median)"


def spread_verdict(a: dict, b: dict, m: str, mode: str) -> tuple:
    """(better | worse | inconclusive, whether `a` is ahead on the median): row `a` against row `b` by metric `m`,
    better or worse where the seeds' ranges do not overlap."""
    ahead = a[f"{m}_median"] < b[f"{m}_median"] if mode == "min" else a[f"{m}_median"] > b[f"{m}_median"]
    if a[f"{m}_max"] < b[f"{m}_min"] or b[f"{m}_max"] < a[f"{m}_min"]:
        return ("better" if ahead else "worse"), ahead
    return "inconclusive", ahead


def versus(rows: list, selection: dict, pairs: list) -> list:
    """One verdict line per (reference, challenger) pair of arms beyond the protocol's GP / DoPr pairs (e.g.
    DoPr-AdamW against SOAP), by the same rule as `verdicts`."""
    by = {r["arm"]: r for r in rows}
    m, mode = selection["metric"], selection["mode"]
    lines = []
    for ref, arm in pairs:
        unknown = [a for a in (ref, arm) if a not in selection["arms"]]
        if unknown:
            raise ValueError(f"--versus {ref}:{arm}: no arm {', '.join(unknown)} in the selection "
                             f"(arms: {', '.join(selection['arms'])})")
        head = f"Verdict, {arm} vs {ref} by {m} ({'lower' if mode == 'min' else 'higher'} is better)"
        a, b = by.get(arm), by.get(ref)
        if not a or not b or a.get("missing") or b.get("missing") or f"{m}_median" not in a or f"{m}_median" not in b:
            lines.append(f"{head}: no verdict, the table is partial.")
            continue
        lines.append(f"{head}, seeds {a['seeds']}: {spread_word(a, b, m, mode, arm)}: median "
                     f"{a[f'{m}_median']:.4g} vs {b[f'{m}_median']:.4g}.")
    return lines


def task_tuning(records: list) -> dict:
    cfg = records[0]["config"]
    t = OmegaConf.select(cfg, "task.tuning") if cfg is not None else None
    if t is None:
        raise SystemExit(f"task {records[0]['summary']['task']} has no task.tuning (metric, mode, report) in its "
                         "config: pass --metric")
    return OmegaConf.to_container(t)


def fresh_seeds_of(configs: Path) -> tuple:
    """(seeds, source): the `seed` of the protocol sweep that runs this conf/tuned/<group> folder
    (conf/sweep/*.yaml with a `+tuned/<group>` parameter), or (None, None)."""
    for preset in sorted((configs.parent.parent / "sweep").glob("*.yaml")):
        params = OmegaConf.select(OmegaConf.load(preset), "hydra.sweeper.params") or {}
        if any(k.lstrip("+") == f"tuned/{configs.name}" for k in params) and "seed" in params:
            return seed_list(str(params["seed"])), str(preset)
    return None, None


def seed_list(spec: str) -> list:
    """Hydra's sweep values of a seed: '3,4,5', 'range(1,11)', '7'."""
    spec = spec.strip()
    if spec.startswith("range(") and spec.endswith(")"):
        return list(range(*(int(x) for x in spec[6:-1].split(","))))
    return [int(x) for x in spec.split(",") if x.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["select", "report"])
    p.add_argument("sweeps", nargs="+", help="the tuning sweeps (select) or the fresh-seed sweeps (report)")
    p.add_argument("--out", required=True, help="where selection.* / protocol.* go")
    p.add_argument("--metric", help="default: the task's task.tuning.metric")
    p.add_argument("--mode", choices=["min", "max"], help="default: the task's task.tuning.mode")
    p.add_argument("--configs", help="select: write one tuned config per arm into this conf/tuned/<group> folder")
    p.add_argument("--selection", help="report: the selection.json that chose the settings")
    p.add_argument("--allow-unequal", action="store_true", help="select: accept unequal trial counts per pair")
    p.add_argument("--accept-edge", metavar="REASON",
                   help="select: write the presets although a winner sits at a grid edge; the reason is recorded")
    p.add_argument("--seeds", help="select: the fresh seeds, fixed now (default: the protocol sweep's seed), e.g. 3,4,5")
    p.add_argument("--versus", action="append", default=[], metavar="REF:ARM",
                   help="report: a verdict line for ARM against REF too (e.g. soap:dopr_adamw); repeatable")
    p.add_argument("--gp-from", metavar="SELECTION_JSON",
                   help="select: take GP arms the sweeps lack from this earlier selection.json (a DoPr rule tuned "
                        "later against an unchanged GP); recorded per arm")
    p.add_argument("--refined", nargs="+", default=[], metavar="SWEEP",
                   help="select: the refine stage's sweeps (each arm's coarse winner refined; see refinement)")
    p.add_argument("--refine-axes", default=",".join(REFINE_AXES),
                   help=f"select: the axes the refinement rule refines, comma-separated (default {','.join(REFINE_AXES)})")
    p.add_argument("--refine-above", type=float, default=REFINE_ABOVE,
                   help=f"select: a winner's neighbour more than this many times away is refined (default {REFINE_ABOVE})")
    p.add_argument("--skip-refine", metavar="REASON",
                   help="select: select although a refinement is due and has not run; the reason is recorded")
    p.add_argument("--refine-command", help="select: the command that runs the refinement, named when it is due")
    args = p.parse_args(argv)
    records = load_records(args.sweeps)
    if not records:
        raise SystemExit(f"no finished job (summary.json) under {args.sweeps}")
    command = "python -m experiments.common.tuning " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    refined = load_records(args.refined)
    stamp = make_stamp(records + refined, command)
    out = Path(args.out)
    try:
        if args.action == "select":
            task = task_tuning(records) if not (args.metric and args.mode) else {}
            seeds, source = (seed_list(args.seeds), "--seeds") if args.seeds else (
                fresh_seeds_of(Path(args.configs)) if args.configs else (None, None))
            if seeds is None:
                raise ValueError("no fresh-seed list to fix: pass --seeds (e.g. 3,4,5; `python -m experiments.common."
                                 "protocol select <task>` passes its preset's) or --configs conf/tuned/<group> of a "
                                 "sweep that sets seed")
            gp_from = None
            if args.gp_from:
                if not Path(args.gp_from).is_file():
                    raise ValueError(f"--gp-from {args.gp_from}: no such selection.json")
                gp_from = (args.gp_from, json.loads(Path(args.gp_from).read_text()))
            refine = args.refine_command or (f"python -m experiments.common.protocol refine "
                                             f"{records[0]['summary'].get('task', '<task>')} [--variant V]")
            sel = select(records, args.metric or task["metric"], args.mode or task["mode"], args.allow_unequal,
                         args.accept_edge, seeds, gp_from, refined, tuple(args.refine_axes.split(",")),
                         args.refine_above, args.skip_refine, refine)
            sel["fresh_seeds_from"] = source
            write_selection(sel, out, stamp, Path(args.configs) if args.configs else None, command)
            for arm, a in sel["arms"].items():
                edge = f"; at the grid's edge: {describe_edges([{'arm': arm, **e} for e in a['at_grid_edge']])}" \
                    if a["at_grid_edge"] else ""
                print(f"{arm}: {settings_count(a)}, chosen {_fmt(a['winner'])} ({sel['metric']} {a['value']:.4g}){edge}")
                if a.get("refinement", {}).get("points"):
                    print(f"  {describe_refinement(arm, a, sel)}")
            print(f"fresh seeds fixed: {sel['fresh_seeds']} ({source})")
        else:
            if not args.selection:
                raise SystemExit("report needs --selection <selection.json>")
            sel = json.loads(Path(args.selection).read_text())
            metrics = task_tuning(records).get("report", [sel["metric"]])
            check_one_base(records)
            rows, every, extra = protocol_tables(records, sel, metrics)
            cols = ["arm", "setting", "seeds", "missing"] + [f"{m}_{s}" for m in metrics
                                                             for s in ("min", "median", "max", "mean", "se")]
            partial = any(r.get("missing") for r in rows)
            what = (f"each arm at its setting chosen on seeds {sel['seeds']} by {sel['metric']} ({sel['mode']}); "
                    "{metric}_min/median/max over seeds, mean and standard error")
            write_table(rows, cols, out / "protocol", stamp,
                        ("PARTIAL (fixed seeds missing: see `missing`). " if partial else "")
                        + f"Fixed fresh seeds {sel['fresh_seeds']} (fixed at selection), {what}")
            pairs = [tuple(v.split(":", 1)) for v in args.versus]
            bad = [v for v, pr in zip(args.versus, pairs) if len(pr) != 2 or not all(pr)]
            if bad:
                raise ValueError(f"--versus {bad[0]}: expected REF:ARM, e.g. soap:dopr_adamw")
            notes = verdicts(rows, sel) + versus(rows, sel, pairs)
            for stale in (out / "protocol_all_seeds.md", out / "protocol_all_seeds.csv"):
                stale.unlink(missing_ok=True)
            if every is not None:
                found = sorted(set(sel["fresh_seeds"]) | set(extra))
                write_table(every, cols, out / "protocol_all_seeds", stamp,
                            f"All seeds found {found}, including {extra} added after the selection fixed "
                            f"{sel['fresh_seeds']}: not the protocol's result; {what}")
                notes.append(f"Seeds {extra} ran beyond the {len(sel['fresh_seeds'])} fixed at selection: the table "
                             "above leaves them out; the table on all seeds is protocol_all_seeds.md.")
            runs = run_rows(records, sel, metrics)
            based = ["base"] if any("base" in r for r in runs) else []
            write_table(runs, [*RUN_COLUMNS, *metrics, *RUN_EXTRAS, *based], out / "protocol_runs", stamp,
                        markdown=False)
            distinct = len({id(r) for _, _, rs in _fresh_runs(records, sel) for r in rs})
            count = (f"{len(runs)} runs" if distinct == len(runs) else
                     f"{len(runs)} rows over {distinct} runs: DoPr at the GP's setting, where that is DoPr's own "
                     "winner, lists DoPr's runs again")
            notes.append(f"Each run: protocol_runs.csv ({count}; one row a run and seed; `fixed` true for the "
                         "fixed fresh seeds, the runs this table aggregates).")
            md = out / "protocol.md"
            md.write_text(md.read_text() + "\n" + "\n\n".join(notes) + "\n")
            for r in rows:
                print(r["arm"], r["seeds"], {m: r.get(f"{m}_median") for m in metrics},
                      f"missing {r['missing']}" if r.get("missing") else "")
            print("\n".join(notes))
    except ValueError as e:
        raise SystemExit(f"refused: {e}")


if __name__ == "__main__":
    main()
