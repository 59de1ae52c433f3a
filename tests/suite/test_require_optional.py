"""`make test` must not pass while a missing optional package silently drops tests (issue 66 item 6)."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]   # tests/: require_optional.py

CASES = '''
import pytest

def test_runs():
    assert 1 + 1 == 2

def test_needs_a_missing_package():
    pytest.importorskip("no_such_package_for_dopr")

def test_skips_for_another_reason():
    pytest.skip("no GPU here")
'''


def _pytest(folder: Path, require: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "DOPR_REQUIRE_OPTIONAL": "1" if require else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "require_optional", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), str(folder)], env=env, capture_output=True, text=True, cwd=folder)


def test_an_importorskip_skip_fails_the_run_only_when_optional_packages_are_required(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    required = _pytest(tmp_path, require=True)
    assert required.returncode == 1, required.stdout
    assert "test_cases.py::test_needs_a_missing_package: could not import 'no_such_package_for_dopr'" in required.stdout
    assert "test_skips_for_another_reason" not in required.stdout.split("DOPR_REQUIRE_OPTIONAL=1")[-1]
    assert _pytest(tmp_path, require=False).returncode == 0


def test_a_module_skipped_at_collection_is_caught_too(tmp_path):
    (tmp_path / "test_module.py").write_text('import pytest\npytest.importorskip("no_such_package_for_dopr")\n\n'
                                             'def test_x():\n    pass\n')
    required = _pytest(tmp_path, require=True)
    assert required.returncode == 1 and "test_module.py: could not import" in required.stdout, required.stdout


def test_make_test_requires_the_optional_packages():
    makefile = (TESTS.parent / "Makefile").read_text()
    recipe = makefile.split("\ntest: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "DOPR_REQUIRE_OPTIONAL=1" in recipe and "pytest" in recipe
