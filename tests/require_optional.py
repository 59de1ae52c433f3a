"""A pytest plugin (loaded by tests/conftest.py): a test module or test skipped by `pytest.importorskip` hides a
whole family when an optional package is missing. `make test` sets DOPR_REQUIRE_OPTIONAL=1: there every such
skip fails the run, naming the package and the test."""
import os

_IMPORT_SKIPS = []


def _import_skip(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and "could not import" in str(report.longrepr[-1]):
        _IMPORT_SKIPS.append(f"{report.nodeid}: {str(report.longrepr[-1]).removeprefix('Skipped: ')}")


def pytest_collectreport(report):
    _import_skip(report)


def pytest_runtest_logreport(report):
    _import_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if _IMPORT_SKIPS and os.environ.get("DOPR_REQUIRE_OPTIONAL") == "1":
        print("\nDOPR_REQUIRE_OPTIONAL=1: these were skipped for a missing optional package (install the dev extra):\n  "
              + "\n  ".join(_IMPORT_SKIPS[:20]) + ("\n  ..." if len(_IMPORT_SKIPS) > 20 else ""))
        session.exitstatus = 1
