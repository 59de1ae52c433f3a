"""The `tuned` presets in two config roots (issue 75 item 7): conf/tuned/ the hand-written ones,
conf_selected/tuned/ the ones the tuning protocol writes (experiments/common/presets.py). One config group:
`+tuned/<group>=<arm>` composes either, a glob sweeps either, and no group is in both roots."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments.common import presets, protocol, tuning

ROOT = Path(__file__).resolve().parents[2]
HAND, SELECTED = ROOT / "conf" / "tuned", ROOT / presets.SELECTED_ROOT / "tuned"


def _groups(folder: Path) -> set:
    return {d.name for d in folder.iterdir() if d.is_dir()}


def test_the_tools_presets_carry_its_note_and_the_hand_written_ones_do_not():
    selected, hand = sorted(SELECTED.glob("*/*.yaml")), sorted(HAND.glob("*/*.yaml"))
    assert len(selected) >= 150 and len(hand) >= 70
    for p in selected:   # as tuning.write_selection writes it: the package line, then "<name>: chosen by ..."
        lines = p.read_text().splitlines()
        assert lines[0] == "# @package _global_" and lines[1].startswith(f"# {p.stem}: {presets.MARK} on seeds "), p
        assert any(l.startswith("# made by: python -m experiments.common.tuning select ") for l in lines), p
    assert [str(p.relative_to(ROOT)) for p in hand if presets.MARK in p.read_text()] == []
    assert [str(p.relative_to(ROOT)) for p in HAND.rglob("*") if p.is_file() and p.suffix != ".yaml"] == []
    assert [str(p.relative_to(ROOT)) for p in SELECTED.rglob("*") if p.is_file() and p.suffix != ".yaml"] == []


def test_no_group_is_in_both_roots_and_every_protocol_writes_to_its_own():
    assert _groups(HAND) & _groups(SELECTED) == set()
    for path in sorted((ROOT / "conf" / "protocol").glob("*.yaml")):
        preset = protocol.load(path.stem)
        for variant in [None, *(preset.get("variants") or {})]:
            spec = protocol.resolve(preset, variant)
            assert spec["configs"] not in _groups(HAND), (path.stem, variant)
            assert spec.get("tuned") in _groups(HAND) | _groups(SELECTED), (path.stem, variant)
    # the plugin that puts conf_selected/ on Hydra's search path names the same folder
    from hydra_plugins import dopr_conf_selected

    assert dopr_conf_selected.SELECTED == ROOT / presets.SELECTED_ROOT and dopr_conf_selected.CONF == ROOT / "conf"


def test_a_selected_preset_composes_through_the_tuned_group(compose):
    text = (SELECTED / "conv_digits_full_protocol" / "dopr_adamw.yaml").read_text()
    want = yaml.safe_load(text)["optim"]["lr"]
    cfg = compose("task=conv_digits", "+tuned/conv_digits_full_protocol=dopr_adamw")
    assert cfg.optim.gp == "adamw" and cfg.optim.ap is True and cfg.optim.lr == want
    # a selected preset builds on a hand-written one across the roots (its defaults name /tuned/<group>)
    assert "- /tuned/feature_learning@_global_: dopr_sgd" in (SELECTED / "feature_learning_protocol" / "dopr_sgd.yaml").read_text()
    assert compose("task=feature_learning", "+tuned/feature_learning_protocol=dopr_sgd").optim.gp == "sgd"
    assert compose("task=conv_digits", "+tuned/conv_digits=adamw").optim.gp == "adamw"   # a hand-written one


def test_a_glob_over_a_selected_group_lists_its_presets_as_the_sweeper_does():
    """Hydra's basic sweeper expands `glob(*)` with the search path it started with (create_config_search_path,
    the search-path plugins included): a `hydra.searchpath` entry in conf/config.yaml is not on it, the plugin is
    (`make demo`: '+tuned/feature_learning_protocol=glob(*)')."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(ROOT / "conf")))
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(
        ["+tuned/feature_learning_protocol=glob(*)", "seed=1"])
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    assert [j[0] for j in jobs] == [f"+tuned/feature_learning_protocol={p.stem}"
                                    for p in sorted((SELECTED / "feature_learning_protocol").glob("*.yaml"))]
    # another Hydra application's config folder gets no conf_selected/
    other = create_config_search_path(str(ROOT / "conf" / "protocol"))
    assert not any(presets.SELECTED_ROOT in e.path for e in other.get_path())


@pytest.mark.slow
def test_run_py_composes_a_selected_preset_from_any_folder(tmp_path):
    for cwd in (ROOT, tmp_path):
        res = subprocess.run([sys.executable, str(ROOT / "run.py"), "task=conv_digits",
                              "+tuned/conv_digits_full_protocol=dopr_adamw", "--cfg", "job"], cwd=cwd,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert yaml.safe_load(res.stdout)["optim"]["lr"] == 0.03, res.stdout


def test_a_hand_written_group_is_refused_naming_both_files(tmp_path):
    assert presets.selected_folder(Path("conf/tuned/sit_mnist_protocol")) == Path("conf_selected/tuned/sit_mnist_protocol")
    assert presets.selected_folder(tmp_path / "x") == tmp_path / "x"
    with pytest.raises(ValueError) as refused:   # this checkout's conf/tuned/feature_learning: hand-written
        presets.refuse_hand_written(tmp_path / presets.SELECTED_ROOT / "tuned" / "feature_learning", ["x", "sgd"])
    assert f"{tmp_path}/conf_selected/tuned/feature_learning/sgd.yaml would share the config group " \
           "tuned/feature_learning with the hand-written conf/tuned/feature_learning/sgd.yaml: " in str(refused.value)
    (tmp_path / "conf" / "tuned" / "mine").mkdir(parents=True)   # a --root tree's own hand-written group
    with pytest.raises(ValueError, match=r"mine/adamw.yaml would share the config group tuned/mine with the hand-"
                                         r"written .*/conf/tuned/mine/: the tool writes its presets to conf_selected/"):
        presets.refuse_hand_written(tmp_path / "conf_selected" / "tuned" / "mine", ["adamw"])
    presets.refuse_hand_written(tmp_path / "conf_selected" / "tuned" / "mine_protocol", ["adamw"])   # a new group


def test_a_protocol_preset_naming_a_hand_written_group_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"task": "feature_learning", "tuned": "feature_learning", "arms": ["sgd"],
                                   "grid": {"optim.lr": [1e-3]}, "tuning_seeds": [0], "fresh_seeds": [1],
                                   "configs": "humanoid", "results": "results/toy"}))
    with pytest.raises(SystemExit) as refused:
        protocol.main(["select", str(bad), "--dry-run", "--root", str(tmp_path)])
    assert "would share the config group tuned/humanoid with the hand-written conf/tuned/humanoid/" in str(refused.value)
