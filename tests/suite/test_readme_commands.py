"""The README's and docs' commands and pointers name things that exist (issue 72 item 9: a report path that
nothing made any more, an optim group list missing soap/shampoo/kron, a preset citing a docs page that does
not exist, no word on comparing a pair at its tuned settings)."""
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_docs_page_a_config_or_page_cites_exists():
    cited = set()
    for path in [*TEXTS, *sorted((ROOT / "conf").rglob("*.yaml"))]:
        cited |= {(path, m) for m in re.findall(r"docs/[\w-]+\.md", path.read_text())}
    missing = sorted(f"{p.relative_to(ROOT)} cites {m}" for p, m in cited if not (ROOT / m).exists())
    assert not missing, missing


def test_a_report_command_names_a_sweep_folder_run_py_makes():
    # multirun/<sweep_name>/<time>: sweep_name is the task's name unless a sweep preset sets its own
    names = {p.stem for p in (ROOT / "conf" / "task").glob("*.yaml")}
    names |= {yaml.safe_load(p.read_text()).get("sweep_name") for p in (ROOT / "conf" / "sweep").glob("*.yaml")}
    for path in TEXTS[:2] + [ROOT / "docs" / "suite.md"]:
        for name in re.findall(r"experiments\.report multirun/([\w-]+)/<time>", path.read_text()):
            assert name in names, f"{path.name}: multirun/{name}/<time> is made by no task or sweep preset"


def test_the_readme_lists_every_optimizer_of_conf_optim_and_how_to_compare_a_pair_tuned():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"`optim/` \(([^)]*)\)", readme).group(1)
    plain = sorted(p.stem for p in (ROOT / "conf" / "optim").glob("*.yaml") if not p.stem.startswith("dopr_"))
    assert [o for o in plain if not re.search(rf"\b{o}\b", listed)] == []
    pair = re.search(r"\+tuned/(\w+)=soap,dopr_soap'", readme)
    assert pair, "the README shows no tuned SOAP pair"
    assert {"soap.yaml", "dopr_soap.yaml"} <= {p.name for r in ("conf", "conf_handwritten")
                                               for p in (ROOT / r / "tuned" / pair.group(1)).glob("*.yaml")}
