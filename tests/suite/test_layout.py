"""The import graph: a tree. No cycles under experiments/, benchmarks/ and dopr/ (function-level
imports included), and the optimizer library imports nothing of the experiment suite or the benchmarks."""
import ast
from pathlib import Path

from test_library_layout import _module_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dopr", "experiments", "benchmarks")


def _imports(path: Path, name: str) -> set:
    """The project modules that `path` imports anywhere in it (absolute and relative)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] in PACKAGES}
    return out


def import_graph() -> dict:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # an import of a.b.c counts as importing the module a.b.c if it exists, else its package a.b
        graph[name] = {t if t in files else t.rsplit(".", 1)[0] for t in _imports(path, name)}
        graph[name] = {t for t in graph[name] if t in files and t != name}
    return graph


def _cycle(graph: dict):
    state = {}

    def visit(n, stack):
        state[n] = "open"
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m, stack + [m])
                if found:
                    return found
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n, [n])
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "experiments.bc.train" in graph and "dopr.optimizer" in graph
    # package __init__ re-exports are edges too, but a package importing its own submodules is how a
    # package is built: leave those out, keep everything else
    packages = {n for n in graph if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    pruned = {n: {m for m in ms if not (n in packages and m.startswith(n + "."))} for n, ms in graph.items()}
    assert _cycle(pruned) is None, f"import cycle: {' -> '.join(_cycle(pruned))}"


def test_the_library_imports_nothing_of_the_suite():
    graph = import_graph()
    leaks = {n: sorted(m for m in ms if not m.startswith("dopr")) for n, ms in graph.items() if n.startswith("dopr")}
    assert not {n: m for n, m in leaks.items() if m}


def test_the_library_is_the_optimizer():
    """`pip install dopr`'s package holds the optimizer: the step benchmark and the rank measures of the
    stable-rank figures live with the suite (issue 47 section 3), and importing dopr loads neither."""
    import subprocess
    import sys

    assert not (ROOT / "dopr" / "bench.py").exists() and not (ROOT / "dopr" / "ranks.py").exists()
    loaded = subprocess.run([sys.executable, "-c", "import sys, dopr; print(' '.join(sys.modules))"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in loaded if m.split(".")[0] in ("experiments", "benchmarks")]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_of_the_library_and_the_suite_imports():
    """The fast tier (`make test-fast`) touches every module: each imports (its optional packages are
    installed by `make test`'s extras), so a broken import shows there, not only in a slow test."""
    import importlib

    names = sorted(n for n in (_module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
                   if not n.endswith("__main__"))
    assert len(names) > 60
    for name in names:
        importlib.import_module(name)


def _sources(*tops: str) -> list:
    """The .py files under ROOT / each of `tops` ("." the whole checkout), hidden folders and run outputs
    (a virtual environment, multirun/, outputs/, data/) left out."""
    import os

    skip = {"multirun", "outputs", "data", "runs", "results", "wandb", "__pycache__"}
    out = []
    for top in tops:
        for folder, dirs, files in os.walk(ROOT / top):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
            out += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(set(out))


def _sys_path_changes(tree) -> list:
    """The lines of `tree` that change sys.path: sys.path.insert / append / extend, an assignment to sys.path
    or a slice of it, site.addsitedir."""
    def is_path(n):
        return isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"

    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                is_path(n.func.value) and n.func.attr in ("insert", "append", "extend") or n.func.attr == "addsitedir"):
            lines.append(n.lineno)
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        lines += [n.lineno for t in targets if is_path(t) or isinstance(t, ast.Subscript) and is_path(t.value)]
    return sorted(lines)


def test_the_tools_are_sorted_by_kind_and_the_wheel_is_dopr_alone():
    """Issue 66 item 5: no .py file of the checkout changes sys.path (the suite, the benchmarks and the studies
    run from the root as `python -m ...`; pytest gets tests/ and the root from pyproject's pythonpath);
    scripts/ holds the shell tools only; no module imports a private name of another package; and the
    packages that pyproject's find configuration selects among the checkout's are dopr and its subpackages."""
    import fnmatch
    import re

    patched = [f"{p.relative_to(ROOT)}:{line}" for p in _sources(".") for line in _sys_path_changes(ast.parse(p.read_text()))]
    assert not patched, f"sys.path changed at {patched}"
    assert _sys_path_changes(ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']")) == [2, 3]
    not_shell = [p.name for p in (ROOT / "scripts").iterdir() if p.is_file() and p.suffix != ".sh"]
    assert not not_shell, f"scripts/ is for the shell tools: {not_shell} (a benchmark goes to benchmarks/, a study to experiments/)"
    private = []
    for p in _sources(*PACKAGES):
        name = _module_name(p)
        own = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] in PACKAGES:
                owner = n.module if (ROOT / n.module.replace(".", "/") / "__init__.py").exists() else n.module.rsplit(".", 1)[0]
                private += [f"{name}: {n.module}.{a.name}" for a in n.names
                            if a.name.startswith("_") and not a.name.startswith("__") and owner != own]
    assert not private, f"private names imported from another package: {private}"
    found = re.search(r"^\[tool\.setuptools\.packages\.find\]\n(?:#.*\n)*include = (\[.*\])$",
                      (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml: [tool.setuptools.packages.find] include = [...]"
    include = ast.literal_eval(found.group(1))
    packages = {_module_name(p.parent / "__init__.py") for p in _sources(".") if p.name == "__init__.py"}
    shipped = {n for n in packages if any(fnmatch.fnmatchcase(n, pattern) for pattern in include)}
    assert "dopr" in shipped and "dopr.gp" in shipped
    assert sorted(n for n in shipped if n.split(".")[0] != "dopr") == []


# ------------------------------------------------------------------ the optimizer's identity as arguments (issue 66)
_STRING_READERS = {"startswith", "endswith", "removeprefix", "removesuffix", "partition", "rpartition", "split",
                   "rsplit", "replace", "find", "rfind", "index", "rindex"}


def _dopr_prefix_parsing(source: str) -> list:
    """The lines of `source` that read an optimizer name by its "dopr_" prefix: a string method called with a
    "dopr..." literal (or f-string, or AP_PREFIX), `"dopr_" in name`, or a [5:] slice on a line naming dopr."""
    def is_prefix(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("dopr")
        if isinstance(node, ast.JoinedStr) and node.values:
            return is_prefix(node.values[0])
        return isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) == "AP_PREFIX"

    lines, found = source.splitlines(), set()
    for n in ast.walk(ast.parse(source)):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _STRING_READERS
                and any(is_prefix(a) for a in n.args)):
            found.add(n.lineno)
        elif (isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops) and is_prefix(n.left)
              and getattr(n.left, "value", "dopr_") == "dopr_"):   # not a key: "dopr" in summary, "dopr_knobs" in arm
            found.add(n.lineno)
        elif (isinstance(n, ast.Slice) and isinstance(n.lower, ast.Constant) and n.lower.value == 5
              and "dopr" in lines[n.lineno - 1]):
            found.add(n.lineno)
    return sorted(found)


def test_no_dopr_prefix_is_parsed_outside_the_one_reader_of_names():
    """An optimizer is (gp, ap): dopr.build(model, gp, ap=...), the suite's `gp:` / `ap:`, tuning's Arm records.
    Its name is derived (dopr.optimizer_name) and read back only by dopr/names.py's split_name."""
    assert _dopr_prefix_parsing('if n.startswith("dopr_"):\n    g = n.removeprefix(f"dopr_{x}")\n'
                                'ok = "dopr_" in n or n[5:] == "dopr"\n') == [1, 2, 3]   # the finder finds them
    assert _dopr_prefix_parsing('c = s["dopr"] if "dopr" in s else {}\nk = "dopr_knobs" in arm\n') == []   # keys
    reader = ROOT / "dopr" / "names.py"
    assert _dopr_prefix_parsing(reader.read_text())   # the reader is where the parsing is
    found = {f"{p.relative_to(ROOT)}:{line}" for pkg in (*PACKAGES, "scripts", "examples") for p in sorted((ROOT / pkg).rglob("*.py"))
             if p != reader for line in _dopr_prefix_parsing(p.read_text())}
    assert not found, f"read the name with dopr.split_name (or experiments.common.arms.Arm.read): {sorted(found)}"


#: the tasks with a tuning protocol: one preset each in conf/protocol/ (issue 66 item 4)
PROTOCOL_TASKS = ("conv_digits", "feature_learning", "humanoid", "robomimic_lift", "sft_arith", "sit_digits",
                  "sit_mnist")


def test_a_tuning_protocol_is_one_preset_per_task_not_copy_edited_sweeps():
    """Each task's protocol (its grids, seeds, variants) lives in conf/protocol/<task>.yaml, run stage by stage by
    `python -m experiments.common.protocol`; conf/sweep/ keeps no *_tune* / *_protocol sweep."""
    sweeps = sorted(p.name for p in (ROOT / "conf" / "sweep").glob("*.yaml") if "_tune" in p.stem or
                    p.stem.endswith("_protocol"))
    assert not sweeps, f"tuning-protocol sweeps belong in conf/protocol/<task>.yaml: {sweeps}"
    presets = sorted(p.stem for p in (ROOT / "conf" / "protocol").glob("*.yaml"))
    assert presets == sorted(PROTOCOL_TASKS)
    assert all((ROOT / "conf" / "task" / f"{t}.yaml").is_file() for t in presets)   # named after a task


# ------------------------------------------------------------------ tests/lib and tests/suite (issue 66 item 6)
def _suite_imports(source: str, suite: set) -> list:
    """(line, module) of each import of `source` whose top-level name is in `suite`: import, from-import,
    pytest.importorskip("...") and importlib.import_module("...")."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            names = [n.module]
        elif (isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) in ("importorskip", "import_module")
              and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
            names = [n.args[0].value]
        else:
            continue
        found += [(n.lineno, m) for m in names if m.split(".")[0] in suite]
    return found


def test_the_library_tests_import_nothing_of_the_suite():
    """tests/lib holds the tests of dopr alone, tests/suite the rest: no test file stays in tests/, and no
    tests/lib file imports experiments, benchmarks, or a module of tests/suite."""
    tests = ROOT / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "a test file goes to tests/lib or tests/suite"
    suite = {"experiments", "benchmarks"} | {p.stem for p in (tests / "suite").glob("*.py")}
    assert _suite_imports("import experiments.common.run\nfrom benchmarks import bench\nimport test_suite\n"
                          "pytest.importorskip('experiments.sit')\nimport dopr, torch\n", suite) == [
        (1, "experiments.common.run"), (2, "benchmarks"), (3, "test_suite"), (4, "experiments.sit")]   # it finds them
    lib = sorted((tests / "lib").glob("test_*.py"))
    assert lib, "tests/lib is empty"
    found = [f"{p.relative_to(ROOT)}:{line} {m}" for p in lib for line, m in _suite_imports(p.read_text(), suite)]
    assert not found, f"a library test imports the suite (move it to tests/suite): {found}"


# ------------------------------------------------------------------ a test of dopr alone lives in tests/lib (issue 75 item 4)
#: the helpers of tests/ by side: the suite's (a task outside the suite, a run of the suite's loop) and the library's
#: (the AP's reference formulas, the process groups); conftest.py and require_optional.py are pytest's plugins
SUITE_HELPERS, LIBRARY_HELPERS, PLUGINS = {"toy_task", "evaluating_task"}, {"reference", "ranks"}, {"conftest", "require_optional"}


def _sides(tests: Path) -> tuple:
    """(suite, library): the top-level module names that make a test the suite's (experiments, benchmarks, the
    suite's configuration by hydra / omegaconf, a tests/suite module, a suite helper) and the library's (dopr,
    a library helper). A tests/lib module is neither: a suite test may reuse its helpers."""
    suite = {"experiments", "benchmarks", "hydra", "omegaconf"} | {p.stem for p in (tests / "suite").glob("*.py")}
    return suite | SUITE_HELPERS, {"dopr"} | LIBRARY_HELPERS


def _imported(node) -> list:
    """The modules `node` itself imports: import, from-import (absolute), pytest.importorskip("...") and
    importlib.import_module("...")."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module and not node.level else []
    if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("importorskip", "import_module")
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def _reached_modules(source: str, given: dict = None, roots=lambda name: name.startswith(("test", "Test"))) -> dict:
    """{name: the top-level names of the modules it reaches} for each module-level def or class of `source` whose
    name `roots` accepts. A def reaches what it imports itself, the fixtures it asks for by argument (a def of the
    module, or one of `given`: {fixture: modules}), the module's autouse fixtures and bare statements (a module-level
    importorskip), and, in turn, what every module-level name it reads reaches (an import, def, class, assignment)."""
    tree, given = ast.parse(source), given or {}
    bindings, everywhere = {}, []

    def bind(stmt):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names = [(a.asname or a.name).split(".")[0] for a in stmt.names]
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [stmt.name]
            if any(k.arg == "autouse" and getattr(k.value, "value", False) for d in stmt.decorator_list
                   if isinstance(d, ast.Call) for k in d.keywords):
                everywhere.append(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for inner in [*stmt.body, *getattr(stmt, "orelse", []), *getattr(stmt, "finalbody", []),
                          *(s for h in getattr(stmt, "handlers", []) for s in h.body)]:
                bind(inner)
            return
        else:
            everywhere.append(stmt)
            return
        for name in names:
            bindings.setdefault(name, []).append(stmt)

    for stmt in tree.body:
        bind(stmt)

    def reach(nodes) -> set:
        modules, seen, todo = set(), set(), list(nodes) + everywhere
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            for n in ast.walk(node):
                modules |= {m.split(".")[0] for m in _imported(n)}
                names = [n.id] if isinstance(n, ast.Name) else [a.arg for a in n.args.args + n.args.kwonlyargs] \
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
                for name in names:
                    modules |= given.get(name, set())
                    todo += bindings.get(name, [])
        return modules

    return {s.name: reach([s]) for s in tree.body
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and roots(s.name)}


def _library_only_tests(source: str, suite: set, library: set, given: dict = None) -> list:
    """The tests of `source` that reach the library (`library`) and nothing of the suite (`suite`, or a fixture of
    `given` that reaches it): tests of dopr alone, which belong in tests/lib."""
    return [name for name, modules in _reached_modules(source, given).items() if modules & library and not modules & suite]


def test_the_library_only_finder_finds_what_the_suite_does_not_need():
    suite, library = {"experiments", "benchmarks", "hydra"}, {"dopr", "reference"}
    source = ('import pytest\nimport torch\nimport dopr\nfrom experiments.common import run\nfrom reference import ap_reference\n'
              'def _model():\n    return torch.nn.Linear(2, 2)\n'
              'def _job():\n    return run.main()\n'
              '@pytest.fixture\ndef job():\n    return _job()\n'
              'def test_library():\n    dopr.build(_model(), "sgd")\n'
              '@pytest.mark.parametrize("m", [_model()])\ndef test_library_helper(m):\n    ap_reference(m)\n'
              'def test_suite_by_helper():\n    dopr.build(_job(), "sgd")\n'
              'def test_suite_by_fixture(job):\n    dopr.build(job, "sgd")\n'
              'def test_suite_by_conftest(compose):\n    dopr.build(compose(), "sgd")\n'
              'def test_suite_inside():\n    from benchmarks import bench\n    dopr.build(bench, "sgd")\n'
              'def test_neither():\n    assert torch.ones(1)\n')
    given = {"compose": {"hydra"}}
    assert _library_only_tests(source, suite, library, given) == ["test_library", "test_library_helper"]
    autouse = '@pytest.fixture(autouse=True)\ndef _config():\n    pytest.importorskip("experiments.sit")\n'
    assert _library_only_tests(source + autouse, suite, library, given) == []   # every test asks for it
    assert _library_only_tests(source + 'pytest.importorskip("hydra")\n', suite, library, given) == []


def test_a_test_of_dopr_alone_is_not_in_the_suite_tests():
    """Issue 75 item 4: a test in tests/suite needs the suite: by what it imports, the fixtures it asks for and
    the module-level names it reads (in turn), it reaches experiments, benchmarks, hydra / omegaconf, a module of
    tests/suite or a suite helper. One that reaches dopr (or a library helper) and none of those is a test of
    dopr alone: it goes to tests/lib, and a suite test may import its helpers from there."""
    tests = ROOT / "tests"
    assert {p.stem for p in tests.glob("*.py")} == SUITE_HELPERS | LIBRARY_HELPERS | PLUGINS, "a new helper of tests/: name its side"
    suite, library = _sides(tests)
    given = _reached_modules((tests / "conftest.py").read_text(), roots=lambda name: True)
    assert given["compose"] & suite and given["demo_file"] & suite and not given["_seed"] & suite
    found = {p.name: _library_only_tests(p.read_text(), suite, library, given) for p in sorted((tests / "suite").glob("test_*.py"))}
    assert not {name: tests for name, tests in found.items() if tests}, "tests of dopr alone: move them to tests/lib"
    lib = {p.name: [t for t, m in _reached_modules(p.read_text(), given).items() if m & suite]
           for p in sorted((tests / "lib").glob("test_*.py"))}
    assert not {name: tests for name, tests in lib.items() if tests}, "tests of tests/lib that need the suite"


# ------------------------------------------------------------------ the module map of docs/suite.md (issue 75 item 6)
def _module_map(text: str, top: str = "dopr/") -> list:
    """[(path, description)] of the entries under `top` in a layout block (docs/suite.md): `top`'s own line
    (its __init__.py) and the lines below it indented two spaces a level, each `name.py` (a module) or `name/`
    (a package: its __init__.py) with its description on the line; a line indented deeper than the next level,
    or not starting with such a name, continues a description; the next unindented line ends the block."""
    import re

    lines = text.splitlines()
    (first,) = [k for k, line in enumerate(lines) if line.startswith(top + " ")]
    out, folders = [(top + "__init__.py", lines[first][len(top):].strip())], [top]
    for line in lines[first + 1:]:
        if not line.startswith(" "):
            break
        indent = len(line) - len(line.lstrip(" "))
        name, _, description = line.strip().partition(" ")
        if indent % 2 or indent // 2 > len(folders) or not re.fullmatch(r"\w+(\.py|/)", name):
            continue
        folders = folders[:indent // 2]
        out.append(("".join(folders) + (name + "__init__.py" if name.endswith("/") else name), description.strip()))
        if name.endswith("/"):
            folders.append(name)
    return out


def test_the_module_map_of_docs_suite_names_every_module_of_dopr():
    """Issue 75 item 6: the layout block of docs/suite.md names every module of dopr/ (a package by its folder's
    line), each once with its one-line description, and no module that is not there."""
    sample = ("dopr/   the library\n  a.py   one\n  sub/   a package\n    b.py   two\n"
              "                 its continuation, c.py\n  c.py   three\nexamples/  x\n  d.py  not the library's\n")
    assert _module_map(sample) == [("dopr/__init__.py", "the library"), ("dopr/a.py", "one"),
                                   ("dopr/sub/__init__.py", "a package"), ("dopr/sub/b.py", "two"), ("dopr/c.py", "three")]
    mapped = _module_map((ROOT / "docs" / "suite.md").read_text())
    paths = [path for path, _ in mapped]
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dopr").rglob("*.py")}
    assert len(modules) > 40 and {"dopr/damping.py", "dopr/graphs.py", "dopr/gp/muon.py"} <= modules
    assert sorted(modules - set(paths)) == [], "docs/suite.md's module map misses these modules of dopr/"
    assert sorted(set(paths) - modules) == [], "docs/suite.md's module map names modules dopr/ does not have"
    assert len(paths) == len(set(paths)) and all(description for _, description in mapped)


# ------------------------------------------------------------------ arrows one way (issue 75 item 5)
def _families() -> list:
    """The experiment families: the packages under experiments/ but common (the plumbing they share)."""
    return sorted(p.parent.name for p in (ROOT / "experiments").glob("*/__init__.py") if p.parent.name != "common")


def _module_strings(source: str, modules) -> list:
    """(line, string) of each string constant of `source` that names one of `modules` or a module under it
    ("experiments.sit", "experiments.bc.train.check_inputs" for experiments.sit, experiments.bc): a module loaded
    by name (importlib, Hydra's get_method) is an import too. Docstrings, which explain, are left out."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and any(n.value == m or n.value.startswith(m + ".") for m in modules)]


def test_the_experiments_import_nothing_of_the_benchmarks():
    """benchmarks/ may import experiments/ (the GPU check times the families' models), never the reverse: a
    family's bench model is a plain function its module exposes, which benchmarks/ registers."""
    graph = import_graph()
    assert "benchmarks.bench" in graph["benchmarks.gpu_check"]   # the graph sees function-level imports
    up = sorted(f"{n} -> {m}" for n, ms in graph.items() if n.startswith("experiments") for m in ms
                if m.startswith("benchmarks"))
    up += [f"{p.relative_to(ROOT)}:{line} {s!r}" for p in sorted((ROOT / "experiments").rglob("*.py"))
           for line, s in _module_strings(p.read_text(), ["benchmarks"])]
    assert not up, f"experiments/ imports benchmarks/: {up}"


def test_common_names_no_family():
    """experiments/common knows no family: no import of one, and no family module named by a string (a family's
    input check is declared by its task config, `task.check_inputs`, as its `entry` and `report` are)."""
    families = _families()
    assert {"bc", "robomimic", "sit", "llm"} <= set(families) and "common" not in families
    modules = [f"experiments.{f}" for f in families]
    assert _module_strings('"""experiments.sit.train"""\nA = {"experiments.sit.train.run": "experiments.sitx"}\n'
                           'B = "experiments.common.run"\n', modules) == [(2, "experiments.sit.train.run")]
    graph = import_graph()
    imports = sorted(f"{n} -> {m}" for n, ms in graph.items() if n.startswith("experiments.common") for m in ms
                     if m.startswith("experiments.") and not m.startswith("experiments.common"))
    assert not imports, f"experiments/common imports a family: {imports}"
    named = [f"{p.relative_to(ROOT)}:{line} {s!r}" for p in sorted((ROOT / "experiments" / "common").rglob("*.py"))
             for line, s in _module_strings(p.read_text(), modules)]
    assert not named, f"experiments/common names a family module: {named}"


def test_no_suite_module_imports_another_modules_private_name():
    """Issue 75 item 7: `protocol.py` imported tuning's private `_text`; a name shared between modules is public."""
    import ast

    offenders = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            ours = isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] in
                                                         ("experiments", "dopr", "benchmarks"))
            if ours:   # a third party's private name (numpy's _reconstruct for torch.load) is that party's affair
                offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders
