"""The library's own layout: every GP of dopr/gp/ is its update formula on the one step, the DoPr class is
small and names no damping rule, and nothing outside dopr/optimizer.py reads DoPr's private state."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _repeated_runs(paths, n: int = 6) -> list:
    """The runs of ``n`` code lines (stripped; blank, comment, import and punctuation-only lines left out)
    that stand in two places or more among ``paths``: [(first place, second place), ...]."""
    seen, repeats = {}, []
    for path in paths:
        lines = [(i, s.strip()) for i, s in enumerate(path.read_text().splitlines(), 1)]
        code = [(i, s) for i, s in lines if any(c.isalnum() for c in s) and not s.startswith(("#", "import ", "from "))]
        for k in range(len(code) - n + 1):
            run = tuple(s for _, s in code[k:k + n])
            place = f"{path.relative_to(ROOT)}:{code[k][0]}"
            if run in seen:
                repeats.append((seen[run], place))
            else:
                seen[run] = place
    return repeats


def test_every_gp_is_its_update_formula_on_the_one_step():
    """Issue 66 item 2: every GP of dopr/gp/ is a BaseGP that writes its update formula (update) and no
    step of its own (the closure, the loop, the skips and refusals are BaseGP's); HybridOptimizer, which
    steps several GPs, is the one other optimizer there. No six code lines stand twice among dopr/gp/."""
    import importlib
    import inspect

    from torch.optim import Optimizer

    from dopr.gp import BaseGP, HybridOptimizer

    files = sorted((ROOT / "dopr" / "gp").glob("*.py"))
    modules = [importlib.import_module(_module_name(p)) for p in files]
    optimizers = {c for m in modules for c in vars(m).values()
                  if isinstance(c, type) and issubclass(c, Optimizer) and c.__module__ == m.__name__}
    gps = optimizers - {BaseGP, HybridOptimizer}
    assert {"SGD", "Signum", "Lion", "Muon", "AdaMuon"} <= {c.__name__ for c in gps}
    # torch.optim.Optimizer wraps a class's step in a hook runner on its first instance: unwrap to compare
    own_step = [c.__name__ for c in gps if inspect.unwrap(c.step) is not inspect.unwrap(BaseGP.step)]
    assert [c.__name__ for c in gps if not issubclass(c, BaseGP) or "update" not in vars(c)] == own_step == []
    assert _repeated_runs(files) == []


def test_dopr_is_small_and_names_no_damping_rule():
    """Issue 66 item 1, issue 75 item 1: the DoPr class at most 300 lines and its precondition at most 19 (as ast
    counts them; the refresh state, the factoring and the factor cache are dopr/refresh.py's, the apply side
    dopr/apply.py's Apply, torch.optim's state-dict hooks dopr/_optimizer_surface.py's), Refresh.factor at most 25, and
    dopr/optimizer.py names no damping rule, no trace mode and no weak-share option or function: a new
    rule is one class in dopr/damping.py plus the option value that chooses it."""
    tree = ast.parse((ROOT / "dopr" / "optimizer.py").read_text())
    (dopr_class,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DoPr"]
    (precondition,) = [n for n in dopr_class.body if isinstance(n, ast.FunctionDef) and n.name == "precondition"]
    (refresh,) = [n for n in ast.parse((ROOT / "dopr" / "refresh.py").read_text()).body
                  if isinstance(n, ast.ClassDef) and n.name == "Refresh"]
    (factor,) = [n for n in refresh.body if isinstance(n, ast.FunctionDef) and n.name == "factor"]
    assert dopr_class.end_lineno - dopr_class.lineno + 1 <= 300
    assert precondition.end_lineno - precondition.lineno + 1 <= 19
    assert factor.end_lineno - factor.lineno + 1 <= 25
    from dopr import damping

    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    used = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings}
    used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    rule_logic = {"damping_scale", "filtered_damping_scale", "direction_energy", "MAX_DOUBLINGS"}
    rules = {"trace", "spectrum", "filter"} | set(damping.RULES) | {c.__name__ for c in damping.RULES.values()}
    named = rules | rule_logic | set(damping.TRACE_MODES) | {"weak_share_bound", "weak_share_estimate"}
    assert not used & named, sorted(used & named)
    health = ast.parse((ROOT / "dopr" / "health.py").read_text())   # the report, no damping rule in it
    defined = {n.name for n in ast.walk(health) if isinstance(n, ast.FunctionDef)}
    assert not (defined | {n.id for n in ast.walk(health) if isinstance(n, ast.Name)}) & rule_logic


#: dopr/'s size, lines of its .py files (wc -l): a ratchet at what the issue-75 cut reached (7,785 -> 6,976), not the
#: issue's 6.0k target, which is missed: 994 of today's lines are files that issues 73, 76 and 77 put in the
#: library after its count (6,069 at 18a18e5): refresh_drift.py (issue 76), graphs.py (77), solve_space.py and tables/
#: (73); lower it when the library shrinks, never raise it to fit a change
MAX_LIBRARY_LINES = 7000


def test_dopr_is_no_larger_than_the_ratchet():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in (ROOT / "dopr").rglob("*.py")}
    biggest = ", ".join(f"{p} {n}" for p, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:5])
    assert sum(sizes.values()) <= MAX_LIBRARY_LINES, f"dopr/ is {sum(sizes.values())} lines (at most " \
        f"{MAX_LIBRARY_LINES}); the largest files: {biggest}"


#: the longest function or method dopr/ may hold, in lines as ast counts them (its def line to its last line)
MAX_FUNCTION_LINES = 60


def test_no_function_in_dopr_is_over_60_lines():
    """Issue 75: no function or method in dopr/ is longer than MAX_FUNCTION_LINES (docstring and comments included);
    a longer one is split into named helpers (find_layers' walk is dopr.layers._ModelMap's, route_matrix_params'
    roles _heads_and_inputs)."""
    long = []
    for path in sorted((ROOT / "dopr").rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{n.lineno} {n.name} is {n.end_lineno - n.lineno + 1} lines "
                            f"(at most {MAX_FUNCTION_LINES})")
    assert long == [], "\n".join(long)


def test_the_capture_asks_the_refresh_object_whether_it_collects():
    """Issue 75: the capture asks the refresh object whether forwards gather (``refresh.gathering``, a plain bool a
    compiled forward guards on); nothing in dopr/ assigns a capture's ``collecting`` (a read-only property now),
    and only dopr/refresh.py assigns ``gathering``."""
    from dopr.capture import ActivationCapture

    assert isinstance(vars(ActivationCapture)["collecting"], property) and vars(ActivationCapture)["collecting"].fset is None
    found = []
    for path in sorted((ROOT / "dopr").rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            targets = (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for t in (e for target in targets for e in ast.walk(target)):
                if isinstance(t, ast.Attribute) and (t.attr == "collecting" or (t.attr == "gathering"
                                                                                  and path.name != "refresh.py")):
                    found.append(f"{path.relative_to(ROOT)}:{t.lineno} .{t.attr} =")
    assert found == []


def _dopr_privates() -> set:
    """DoPr's private attributes and methods (``self._x`` in dopr/optimizer.py), but torch.optim.Optimizer's own."""
    from torch.optim import Optimizer

    tree = ast.parse((ROOT / "dopr" / "optimizer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DoPr"]
    names = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__")}
    names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
              and not n.name.startswith("__")}
    return names - set(dir(Optimizer)) - {n for n in names if n.startswith("_optimizer_")}


#: the DoPr private state tests/lib still reads: none (the apply side's is ``opt.apply``'s, dopr/apply.py)
TESTS_STILL_READ: set = set()


def test_nothing_outside_the_optimizer_reads_doprs_private_state():
    """Issue 75 item 1: dopr/, benchmarks/ and experiments/ reach DoPr through its public methods (``layers()``,
    ``refresh``, ``apply``, ``capture``, ``graphs``, ``ap_state_dict``...) and its refresh object's (dopr/refresh.py): no ``x._name`` of a
    DoPr private attribute but on ``self``, outside dopr/optimizer.py; tests/lib none but TESTS_STILL_READ."""
    private = _dopr_privates()
    assert {"_capture", "_refresh", "_apply", "_step", "_warmed"} <= private
    found = []
    for top in ("dopr", "benchmarks", "experiments", "tests/lib"):
        allowed = TESTS_STILL_READ if top == "tests/lib" else set()
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "dopr" / "optimizer.py":
                continue
            for n in ast.walk(ast.parse(path.read_text())):
                if (isinstance(n, ast.Attribute) and n.attr in private - allowed
                        and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                    found.append(f"{path.relative_to(ROOT)}:{n.lineno} .{n.attr}")
    assert found == []


def _dopr_imports(path: Path) -> set:
    """The dopr modules ``path`` imports (module level or in a function), as dotted names under dopr."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:   # relative: from the file's own package
                base = ".".join(_module_name(path).split(".")[:-n.level]) + ("." + n.module if n.module else "")
            out |= {base} | {f"{base}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
    return {m for m in out if m == "dopr" or m.startswith("dopr.")}


def test_statistics_and_the_sample_space_import_neither_the_damping_rules_nor_the_options():
    """Issue 75: dopr/statistics.py and dopr/sample_space.py are the statistics and their solves; the damping rules
    (dopr/damping.py: the trace floor comes in as ``prepare``'s ``floor``) and the options (dopr/options.py: the
    sample space says itself what blocks it, ``sample_space_blocker``) build on them, not the other way round."""
    for name in ("statistics.py", "sample_space.py"):
        imported = _dopr_imports(ROOT / "dopr" / name)
        assert {"dopr.damping", "dopr.options"} & imported == set(), (name, sorted(imported))
    assert "dopr.damping" in _dopr_imports(ROOT / "dopr" / "refresh.py")   # the parser sees relative imports


def test_only_the_rule_and_the_quantity_name_the_sample_count():
    """Issue 75 item 2: the per-layer quantities travel by name (dopr/quantities.py, ``stat.extras``); no library
    file reads a statistic's ``.samples`` or a rule's ``reads_samples``, and only the rule (dopr/damping.py) and
    the quantity's registration (dopr/sample_count.py) name the quantity "samples" as an ``extras`` key or a read."""
    found = []
    for path in sorted((ROOT / "dopr").rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in ("samples", "reads_samples", "count_samples"):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno} .{n.attr}")
        text = path.read_text()
        if path.name not in ("damping.py", "sample_count.py") and any(
                s in text for s in ('extras["samples"]', 'extras.get("samples")', '("samples",)', 'quantity("samples"')):
            found.append(f"{path.relative_to(ROOT)}: names the quantity 'samples'")
    assert found == []
