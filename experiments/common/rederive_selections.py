"""Re-derive the committed tuning selections under the protocol's current rules, without the tuning
jobs (their multirun folders are not committed) and without running anything.

For each committed results/**/selection.json: the winners at the edge of a numeric axis (two-value
axes included), and for each committed DoPr-at-the-GP preset (conf/tuned/*_protocol/*_at_gp*.yaml)
the keys of the GP's winning setting it failed to copy. The GP's and DoPr's winning configs are
composed with Hydra from the protocol sweep and each arm's recorded overrides, which stands in for
the tuning jobs' .hydra/config.yaml.

    python -m experiments.common.rederive_selections            # list edges and at-GP mismatches
    python -m experiments.common.rederive_selections --write    # also rewrite selection.json/.md and the presets
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import yaml

from experiments.common import tuning

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
ACCEPTED = ("re-derived from the committed selection.json by experiments/common/rederive_selections.py, which runs nothing: "
            "the grids were not widened and the committed results ran these winners; widen the flagged axes "
            "before the next protocol run")


def _compose(overrides: list):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def committed() -> list:
    """[(selection.json, conf/tuned/<group>, the select command)] from the presets' notes."""
    found = {}
    for preset in sorted(CONF.glob("tuned/*_protocol/*.yaml")):
        text = preset.read_text()
        see = re.search(r"see (\S+)/selection\.md", text)
        made = re.search(r"made by: (.*)", text)
        if see:
            found[ROOT / see.group(1) / "selection.json"] = (preset.parent, made.group(1) if made else "")
    return [(sel, group, cmd) for sel, (group, cmd) in sorted(found.items())]


def rederive(path: Path, group: Path) -> dict:
    sel = json.loads(path.read_text())
    sel["pairs"] = [tuple(p) for p in sel["pairs"]]
    seeds, source = tuning.fresh_seeds_of(group)
    sweep = Path(source).stem
    for arm, a in sel["arms"].items():
        a["at_grid_edge"], a["unordered_axes"] = tuning.grid_edges(a["grid"], a["winner"])
        cfg = _compose([f"sweep={sweep}"] + [f"{k}={v}" for k, v in {**a["base"], **a["winner"]}.items()])
        a["resolved"] = tuning.resolved_setting(cfg)
        if tuning.Arm.read(arm).ap:
            a["dopr_knobs_fixed"], a["dopr_knobs_tuned"] = tuning.dopr_knobs(a)
    edges = [{"arm": arm, **e} for arm, a in sel["arms"].items() for e in a["at_grid_edge"]]
    sel["fresh_seeds"], sel["fresh_seeds_from"] = seeds, f"{Path(source).relative_to(ROOT)} (recorded afterwards by " \
                                                         "experiments/common/rederive_selections.py)"
    sel["accept_edge"] = {"reason": ACCEPTED, "edges": edges} if edges else None
    return sel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite selection.json/.md and the presets")
    args = p.parse_args()
    os.chdir(ROOT)
    for path, group, command in committed():
        sel = rederive(path, group)
        print(f"## {path.relative_to(ROOT)} (presets {group.relative_to(ROOT)}; fresh seeds {sel['fresh_seeds']})")
        for arm, a in sel["arms"].items():
            edges = tuning.describe_edges([{"arm": arm, **e} for e in a["at_grid_edge"]]) or "none"
            grid = " x ".join(f"{k}({len(v)})" for k, v in a["grid"].items())
            print(f"  edge  {arm}: winner {tuning._fmt(a['winner'])}; grid {grid}; at an edge: {edges}")
        for gp, dopr in sel["pairs"]:
            print(f"  knobs {dopr}: {tuning.describe_knobs(sel['arms'][dopr])}")
            want, _ = tuning.gp_setting_for_dopr(sel, gp, dopr)
            gp_all = {k.lstrip("+"): v for k, v in tuning.chosen_settings(sel)[gp].items()}
            for old in sorted(group.glob(f"{dopr}_at_gp*.yaml")):
                body = yaml.safe_load(old.read_text())
                have = _flat({k: v for k, v in body.items() if k != "defaults"})
                wrong = {k.lstrip("+"): (have.get(k.lstrip("+")), v) for k, v in want.items() if "/" not in k
                         and not k.lstrip("+").startswith("ap.")
                         and not tuning.same_value(tuning.parse_value(str(v)), have.get(k.lstrip("+"), "<unset>"))}
                dopr_res = sel["arms"][dopr]["resolved"]
                text = "; ".join(f"{k} {h if h is not None else dopr_res.get(k)} (DoPr's) vs {gp}'s {v}"
                                 for k, (h, v) in wrong.items()) or "none: it already ran the GP's whole setting"
                print(f"  at-GP {old.relative_to(ROOT)}: keys of {gp}'s winner not copied: {text}")
            del gp_all
        if args.write:
            md = path.with_suffix(".md").read_text().splitlines()
            stamp = md[2] if len(md) > 2 else ""
            tuning.write_selection(sel, path.parent.relative_to(ROOT), stamp, group.relative_to(ROOT), command)
            print(f"  wrote {path.relative_to(ROOT)}, selection.md, {group.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
