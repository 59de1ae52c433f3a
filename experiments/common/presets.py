"""Where the `tuned` config group lives: one group, two config roots.

    conf/tuned/<group>/<arm>.yaml              the presets the tuning protocol writes (tuning.write_selection,
                                               `python -m experiments.common.protocol select <task>`), each
                                               headed by the tool's note (MARK) and its `made by:` line
    conf_handwritten/tuned/<group>/<arm>.yaml  the hand-written presets (the paper's tables, the hand-set bases
                                               the protocol's arms start from)

Hydra composes the group over its search path, and hydra_plugins/dopr_conf_handwritten.py puts conf_handwritten/
on it after conf/: `+tuned/<group>=<arm>` names either kind. A group lives in one root only: select refuses to
write a group that conf_handwritten/tuned/ has (`refuse_hand_written`), and tests/suite/test_conf_handwritten.py
checks the committed ones.
"""
from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
#: the second config root, beside conf/ (the plugin names the same folder)
HANDWRITTEN_ROOT = "conf_handwritten"
#: the words of the note that heads every preset the tool writes (tuning.write_selection)
MARK = "chosen by the tuning protocol (experiments/common/tuning.py)"


def roots(conf: Path) -> list:
    """The config roots of the suite whose conf/ is `conf`: conf/, then conf_handwritten/ beside it."""
    return [conf, conf.parent / HANDWRITTEN_ROOT]


def _shown(path: Path) -> str:
    path = Path(path).absolute()
    return str(path.relative_to(CHECKOUT)) if path.is_relative_to(CHECKOUT) else str(path)


def hand_written(configs: Path) -> list:
    """The hand-written folders of the group `configs` (a conf/tuned/<group> folder) would be:
    conf_handwritten/tuned/<group> of this checkout (the config root every run composes from) and, for a folder
    under another tree's conf/tuned/ (protocol --root), that tree's conf_handwritten/tuned/<group>; those that exist."""
    configs = Path(configs).absolute()
    found = [CHECKOUT / HANDWRITTEN_ROOT / "tuned" / configs.name]
    if configs.parent.name == "tuned" and configs.parent.parent.name == "conf":
        found.append(configs.parent.parent.parent / HANDWRITTEN_ROOT / "tuned" / configs.name)
    return [f for i, f in enumerate(found) if f.is_dir() and f.resolve() not in [g.resolve() for g in found[:i]]]


def refuse_hand_written(configs: Path, names: list) -> None:
    """A ValueError naming both files when the group of `configs` is a hand-written one: the tool's presets
    would share the group `tuned/<group>` with the hand-written ones (and a same-named file in conf/ would
    win over the hand-written one)."""
    for folder in hand_written(configs):
        clash = next((n for n in names if (folder / f"{n}.yaml").is_file()), None)
        name = clash or (names[0] if names else "<arm>")
        theirs = folder / f"{clash}.yaml" if clash else folder
        raise ValueError(f"{_shown(Path(configs) / f'{name}.yaml')} would share the config group tuned/{Path(configs).name} "
                         f"with the hand-written {_shown(theirs)}{'' if clash else '/'}: the tool writes its presets "
                         f"to conf/tuned/<group>, hand-written ones live in {HANDWRITTEN_ROOT}/tuned/; choose a group "
                         f"name that {HANDWRITTEN_ROOT}/tuned/ does not have (a protocol preset's `configs`)")
