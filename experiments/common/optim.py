"""The `optim` config group: an optimizer's identity, and the generated `dopr_<gp>` configs.

A plain GP's config (`conf/optim/<gp>.yaml`) says `gp: <gp>`, `ap: false` and the GP's arguments;
`conf/optim/dopr_<gp>.yaml` is generated from it (`python -m experiments.common.optim` writes the missing
ones, `--check` says which differ; tests/suite/test_suite.py checks every registered GP): the plain config with
`ap: true`. No config carries a name: every reader of which optimizer a run uses calls
:func:`optim_identity`, and :func:`optim_name` derives its name (run folders, summary.json's "optim").
"""
from __future__ import annotations

import sys
from pathlib import Path

from dopr import optimizer_name, split_name
from dopr.gp import GPS

from .provenance import ROOT

#: keys of the `optim` group that say which optimizer, not what it is given (`name`: runs written before)
IDENTITY_KEYS = ("name", "gp", "ap")


def optim_identity(optim) -> tuple:
    """(gp, ap) of an `optim` config (a DictConfig or dict): its `gp` and `ap` keys; a config written
    before those keys (an earlier run's .hydra/config.yaml) by its `name`, which, where both are given,
    must agree with them."""
    if "gp" not in optim and "ap" not in optim:
        if "name" not in optim:
            raise ValueError(f"the optim config names no optimizer: it needs gp: and ap: (has {sorted(optim)})")
        return split_name(str(optim["name"]))
    gp, ap = str(optim.get("gp")), optim.get("ap")
    if not isinstance(ap, bool):
        raise ValueError(f"optim.ap={ap}: must be true or false")
    name = optim.get("name")
    if name is not None and optimizer_name(gp, ap) != name:
        raise ValueError(f"optim.name={name} but optim.gp={gp} with optim.ap={str(ap).lower()} is "
                         f"{optimizer_name(gp, ap)}: choose optim={optimizer_name(gp, ap)} (conf/optim/)")
    return gp, ap


def optim_name(optim) -> str:
    """The name of an `optim` config's optimizer, derived from its identity: "adamw", "dopr_adamw"."""
    return optimizer_name(*optim_identity(optim))


def gp_arguments(optim: dict) -> dict:
    """The `optim` config's arguments of the GP (all but its identity keys)."""
    return {k: v for k, v in optim.items() if k not in IDENTITY_KEYS}


def dopr_config_text(gp: str) -> str:
    """The text of conf/optim/dopr_<gp>.yaml: the plain config, wrapped in DoPr."""
    return (f"# DoPr with {gp} as the gradient preconditioner; the AP's options are the `ap` group (conf/ap/)\n"
            f"# Generated from conf/optim/{gp}.yaml by `python -m experiments.common.optim`: edit that one\n"
            f"defaults:\n  - {gp}\n  - _self_\n\n"
            f"ap: true\n")


def main(argv=None, conf: Path = ROOT / "conf") -> int:
    """Write conf/optim/dopr_<gp>.yaml for every registered GP with a conf/optim/<gp>.yaml; with
    ``--check``, write nothing and list those missing or different (exit status 1)."""
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    stale = []
    for gp in GPS:
        if not (conf / "optim" / f"{gp}.yaml").exists():
            print(f"conf/optim/{gp}.yaml: missing (write the plain GP's config first)")
            stale.append(gp)
            continue
        path = conf / "optim" / f"{optimizer_name(gp, True)}.yaml"
        if not path.exists() or path.read_text() != dopr_config_text(gp):
            stale.append(gp)
            if not check:
                path.write_text(dopr_config_text(gp))
            print(f"{path.relative_to(conf.parent)}: {'differs' if check else 'written'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
