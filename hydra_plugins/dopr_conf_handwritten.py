"""The suite's second config root, conf_handwritten/: the hand-written `tuned` presets (the paper's tables and
the hand-set bases the protocol's arms start from, conf_handwritten/tuned/<group>/<arm>.yaml), apart from
conf/tuned/, which is the tuning protocol tool's: `python -m experiments.common.protocol select <task>` writes
conf/tuned/<group>/<arm>.yaml, each headed by its note. Both are the same config group `tuned`: Hydra merges a
group over its search path, so `+tuned/<group>=<arm>` (and `'+tuned/<group>=glob(*)'`) composes either kind, and
a tool's preset builds on a hand-written base (`- /tuned/conv_digits@_global_: dopr_adamw`) across the roots.

This is a Hydra SearchPathPlugin (Hydra finds it in the `hydra_plugins` namespace package when the checkout's
root is on sys.path: run.py's folder, `python -m` from the root, pytest's pythonpath). It adds conf_handwritten/
after conf/ whenever conf/ of this checkout is the primary config folder (run.py, the tests' and tools'
initialize_config_dir), and leaves any other Hydra application alone. A `hydra.searchpath` entry in
conf/config.yaml would compose the presets too, but Hydra 1.3 expands a `glob(*)` sweep with the search path
it started with, without the primary config's entries: the glob would launch no job.

It imports nothing of the suite (the scanner imports it in every Hydra process); experiments/common/presets.py
names the same folder (HANDWRITTEN_ROOT; tests/suite/test_conf_handwritten.py checks that they agree).
"""
import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CHECKOUT = Path(__file__).resolve().parents[1]
CONF = CHECKOUT / "conf"
HANDWRITTEN = CHECKOUT / "conf_handwritten"


def _folder(path: str) -> str:
    return os.path.realpath(path.removeprefix("file://"))


class HandwrittenPresetsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        mains = [_folder(e.path) for e in search_path.get_path() if e.provider == "main" and e.path]
        if str(CONF.resolve()) in mains:
            search_path.append(provider="dopr-conf-handwritten", path=f"file://{HANDWRITTEN}")
