"""The suite's second config root, conf_selected/: the presets the tuning protocol writes
(`python -m experiments.common.protocol select <task>` -> conf_selected/tuned/<group>/<arm>.yaml), apart
from the hand-written ones in conf/tuned/. Both are the config group `tuned`: Hydra merges a group over
its search path, so `+tuned/<group>=<arm>` (and `'+tuned/<group>=glob(*)'`) composes either kind.

This is a Hydra SearchPathPlugin (Hydra finds it in the `hydra_plugins` namespace package when the checkout's
root is on sys.path: run.py's folder, `python -m` from the root, pytest's pythonpath). It adds conf_selected/
after conf/ whenever conf/ of this checkout is the primary config folder (run.py, the tests' and tools'
initialize_config_dir), and leaves any other Hydra application alone. A `hydra.searchpath` entry in
conf/config.yaml would compose the presets too, but Hydra 1.3 expands a `glob(*)` sweep with the search path
it started with, without the primary config's entries: the glob would launch no job.

It imports nothing of the suite (the scanner imports it in every Hydra process); experiments/common/tuning.py
names the same folder (SELECTED_ROOT; tests/suite/test_conf_selected.py checks that they agree).
"""
import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CHECKOUT = Path(__file__).resolve().parents[1]
CONF = CHECKOUT / "conf"
SELECTED = CHECKOUT / "conf_selected"


def _folder(path: str) -> str:
    return os.path.realpath(path.removeprefix("file://"))


class SelectedPresetsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        mains = [_folder(e.path) for e in search_path.get_path() if e.provider == "main" and e.path]
        if str(CONF.resolve()) in mains:
            search_path.append(provider="dopr-conf-selected", path=f"file://{SELECTED}")
