"""The `tuned` presets in two config roots (issue 75 item 7): conf/tuned/ the ones the tuning protocol writes,
conf_handwritten/tuned/ the hand-written ones (experiments/common/presets.py). One config group:
`+tuned/<group>=<arm>` composes either, a glob sweeps either, and no group is in both roots."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments.common import presets, protocol

ROOT = Path(__file__).resolve().parents[2]
TOOL, HAND = ROOT / "conf" / "tuned", ROOT / presets.HANDWRITTEN_ROOT / "tuned"


def _groups(folder: Path) -> set:
    return {d.name for d in folder.iterdir() if d.is_dir()}


def test_the_tools_presets_carry_its_note_and_the_hand_written_ones_do_not():
    tool, hand = sorted(TOOL.glob("*/*.yaml")), sorted(HAND.glob("*/*.yaml"))
    assert len(tool) >= 150 and len(hand) >= 70
    for p in tool:   # as tuning.write_selection writes it: the package line, then "<name>: chosen by ..."
        lines = p.read_text().splitlines()
        assert lines[0] == "# @package _global_" and lines[1].startswith(f"# {p.stem}: {presets.MARK} on seeds "), p
        assert any(l.startswith("# made by: python -m experiments.common.tuning select ") for l in lines), p
    assert [str(p.relative_to(ROOT)) for p in hand if presets.MARK in p.read_text() or "made by:" in p.read_text()] == []
    assert [str(p.relative_to(ROOT)) for p in HAND.rglob("*") if p.is_file() and p.suffix != ".yaml"] == []
    assert [str(p.relative_to(ROOT)) for p in TOOL.rglob("*") if p.is_file() and p.suffix != ".yaml"] == []


def test_no_group_is_in_both_roots_and_no_protocol_writes_a_hand_written_one():
    assert _groups(HAND) & _groups(TOOL) == set()
    for path in sorted((ROOT / "conf" / "protocol").glob("*.yaml")):
        preset = protocol.load(path.stem)
        for variant in [None, *(preset.get("variants") or {})]:
            spec = protocol.resolve(preset, variant)
            assert spec["configs"] not in _groups(HAND), (path.stem, variant)
            assert spec.get("tuned") in _groups(HAND) | _groups(TOOL), (path.stem, variant)
    # the plugin that puts conf_handwritten/ on Hydra's search path names the same folder
    from hydra_plugins import dopr_conf_handwritten

    assert dopr_conf_handwritten.HANDWRITTEN == ROOT / presets.HANDWRITTEN_ROOT
    assert dopr_conf_handwritten.CONF == ROOT / "conf"


def test_a_tool_preset_and_a_hand_written_one_compose_through_the_tuned_group(compose):
    text = (TOOL / "conv_digits_full_protocol" / "dopr_adamw.yaml").read_text()
    want = yaml.safe_load(text)["optim"]["lr"]
    # a tool's preset builds on a hand-written base across the roots (its defaults name /tuned/<group>)
    assert "- /tuned/conv_digits@_global_: dopr_adamw" in text and (HAND / "conv_digits" / "dopr_adamw.yaml").is_file()
    cfg = compose("task=conv_digits", "+tuned/conv_digits_full_protocol=dopr_adamw")
    assert cfg.optim.gp == "adamw" and cfg.optim.ap is True and cfg.optim.lr == want
    assert "- /tuned/feature_learning@_global_: dopr_sgd" in (TOOL / "feature_learning_protocol" / "dopr_sgd.yaml").read_text()
    assert compose("task=feature_learning", "+tuned/feature_learning_protocol=dopr_sgd").optim.gp == "sgd"
    # hand-written ones
    want = yaml.safe_load((HAND / "humanoid" / "dopr_adamw.yaml").read_text())["paper_hparams"]   # per trajectory count
    cfg = compose("task=humanoid", "+tuned/humanoid=dopr_adamw", "task.num_trajectories=30")
    assert cfg.optim.gp == "adamw" and cfg.optim.ap is True and cfg.optim.lr == want["30"]["lr"]
    assert compose("task=conv_digits", "+tuned/conv_digits=adamw").optim.gp == "adamw"


def _sweep_jobs(*overrides) -> list:
    """The jobs Hydra's basic sweeper makes of `overrides`: it expands `glob(*)` with the search path it started
    with (create_config_search_path, the search-path plugins included): a `hydra.searchpath` entry in
    conf/config.yaml is not on it, the plugin is."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(ROOT / "conf")))
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def test_a_glob_over_either_kind_of_group_lists_its_presets_as_the_sweeper_does():
    for group, folder in (("humanoid", HAND), ("feature_learning_protocol", TOOL)):   # `make demo` globs the latter
        jobs = _sweep_jobs(f"+tuned/{group}=glob(*)", "seed=1")
        assert [j[0] for j in jobs] == [f"+tuned/{group}={p.stem}" for p in sorted((folder / group).glob("*.yaml"))]
        assert len(jobs) >= 2
    # another Hydra application's config folder gets no conf_handwritten/
    from hydra._internal.utils import create_config_search_path

    other = create_config_search_path(str(ROOT / "conf" / "protocol"))
    assert not any(presets.HANDWRITTEN_ROOT in e.path for e in other.get_path())


@pytest.mark.slow
def test_run_py_composes_either_kind_from_any_folder(tmp_path):
    for cwd in (ROOT, tmp_path):
        for args, key in ((["task=conv_digits", "+tuned/conv_digits_full_protocol=dopr_adamw"], "optim"),
                          (["task=humanoid", "+tuned/humanoid=dopr_adamw"], "paper_hparams")):
            res = subprocess.run([sys.executable, str(ROOT / "run.py"), *args, "--cfg", "job"], cwd=cwd,
                                 capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr[-2000:]
            preset = TOOL / "conv_digits_full_protocol" if key == "optim" else HAND / "humanoid"
            want = yaml.safe_load((preset / "dopr_adamw.yaml").read_text())[key]
            got = yaml.safe_load(res.stdout)[key]
            assert (got["lr"] == want["lr"] if key == "optim" else got == want), res.stdout


def test_a_hand_written_group_is_refused_naming_both_files(tmp_path):
    with pytest.raises(ValueError) as refused:   # this checkout's conf_handwritten/tuned/feature_learning
        presets.refuse_hand_written(tmp_path / "conf" / "tuned" / "feature_learning", ["x", "sgd"])
    assert f"{tmp_path}/conf/tuned/feature_learning/sgd.yaml would share the config group " \
           "tuned/feature_learning with the hand-written conf_handwritten/tuned/feature_learning/sgd.yaml: " \
           in str(refused.value)
    (tmp_path / "conf_handwritten" / "tuned" / "mine").mkdir(parents=True)   # a --root tree's own hand-written group
    with pytest.raises(ValueError, match=r"mine/adamw.yaml would share the config group tuned/mine with the hand-"
                                         r"written .*/conf_handwritten/tuned/mine/: the tool writes its presets to "
                                         r"conf/tuned/<group>"):
        presets.refuse_hand_written(tmp_path / "conf" / "tuned" / "mine", ["adamw"])
    presets.refuse_hand_written(tmp_path / "conf" / "tuned" / "mine_protocol", ["adamw"])   # a new group
    presets.refuse_hand_written(ROOT / "conf" / "tuned" / "feature_learning_protocol", ["sgd"])   # the tool's own


def test_a_protocol_preset_naming_a_hand_written_group_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"task": "feature_learning", "tuned": "feature_learning", "arms": ["sgd"],
                                   "grid": {"optim.lr": [1e-3]}, "tuning_seeds": [0], "fresh_seeds": [1],
                                   "configs": "humanoid", "results": "results/toy"}))
    with pytest.raises(SystemExit) as refused:
        protocol.main(["select", str(bad), "--dry-run", "--root", str(tmp_path)])
    assert "would share the config group tuned/humanoid with the hand-written conf_handwritten/tuned/humanoid/" \
        in str(refused.value)
