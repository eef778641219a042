"""The suite's skip policy (tests/conftest.py), run on a small planted suite in a separate pytest process:
with CI=true a skip for a missing package or library fails the run, the allow-listed ones do not, and every run
ends with its skips counted and their reasons (pyproject's addopts)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomllib's ancestor, a dependency of pip's tooling and of pytest < 8.4
    import tomli as tomllib

pytest_plugins = ["pytester"]

PLANTED = '''
import pytest

def test_runs():
    pass

def test_needs_a_missing_package():
    pytest.importorskip("no_such_package_xyz")

@pytest.mark.parametrize("case", ["cpu", pytest.param("nvme", marks=pytest.mark.skipif(True, reason="no libaio"))])
def test_cases(case):
    pass

@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu():
    pass
'''
MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_package_xyz")\n\ndef test_never_collected():\n    pass\n'


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """The planted tests, under this project's conftest and pyproject pytest settings."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    pytester.makeini("[pytest]\naddopts = " + " ".join(addopts) + "\n")
    pytester.makepyfile(test_planted=PLANTED)
    return pytester


def test_outside_ci_skips_pass_and_are_counted_with_their_reasons(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest_subprocess()
    result.assert_outcomes(passed=2, skipped=3)
    result.stdout.fnmatch_lines(["*short test summary info*", "SKIPPED [[]1[]] *could not import*no_such_package_xyz*",
                                 "SKIPPED [[]1[]] *no libaio", "SKIPPED [[]1[]] *needs CUDA"])
    assert result.ret == pytest.ExitCode.OK


def test_in_ci_a_skip_for_a_missing_package_fails_the_run(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest_subprocess()
    # the missing package and the parametrised case that cannot run fail; the GPU test stays skipped
    result.assert_outcomes(passed=2, failed=1, errors=1, skipped=1)
    result.stdout.fnmatch_lines(["*skipped in CI: could not import 'no_such_package_xyz'*",
                                 "*skipped in CI: no libaio*", "SKIPPED [[]1[]] *needs CUDA"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_in_ci_a_module_level_skip_is_a_collection_error(suite, monkeypatch):
    suite.makepyfile(test_module_skip=MODULE_SKIP)
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest_subprocess("test_module_skip.py")
    result.stdout.fnmatch_lines(["*ERROR collecting test_module_skip.py*", "*skipped in CI: could not import*"])
    # The run fails: under the project's addopts (-n 2, as CI runs) xdist reports a collection error as a failure
    # (a one-process session would be interrupted, exit 2).
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    monkeypatch.delenv("CI")
    result = suite.runpytest_subprocess("test_module_skip.py")
    result.assert_outcomes(skipped=1)

