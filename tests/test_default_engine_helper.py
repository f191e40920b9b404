"""An outside plugin wraps the default engine through the public helper alone
(``pytest_dflash.default_engine``), importing no internal module, and the gate it wraps runs
through the wrapper."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

# imported once here: pytester's in-process runs drop modules they import, and datasets
# cannot be imported twice in one process (pyarrow extension types are registered globally)
pytest.importorskip("datasets")

WRAPPER = '''
"""An outside project's engine plugin: counts every score call of the default engine."""
import json
import os

import pytest_dflash

CALLS = {}


class Counting:
    def __init__(self, inner):
        self.inner = inner
        self.selection = inner.selection
        self.capabilities = inner.capabilities  # what it can measure: the inner one's

    def score(self, token_ids):
        key = self.selection["prefill.geometry"]
        CALLS[key] = CALLS.get(key, 0) + 1
        with open(os.environ["WRAP_LOG"], "w") as fh:
            json.dump(CALLS, fh)
        return self.inner.score(token_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def pytest_dflash_engine(config, selection, profile):
    return Counting(pytest_dflash.default_engine(config, selection))
'''


def test_wrapper_plugin_imports_only_the_public_package() -> None:
    imported = set()
    for node in ast.walk(ast.parse(WRAPPER)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported == {"json", "os", "pytest_dflash"}


def test_public_package_imports_without_torch() -> None:
    code = (
        "import sys, pytest_dflash; assert callable(pytest_dflash.default_engine); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_outside_plugin_wraps_the_default_engine(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_dflash.engines.data import PPL_FILE, data_dir

    pytester.makepyfile(wrapping_plugin=WRAPPER)
    data = pytester.mkdir("data")
    rows = (data_dir() / PPL_FILE).read_text().splitlines()[:2]
    (data / PPL_FILE).write_text("\n".join(rows) + "\n")
    log = pytester.path / "calls.json"
    monkeypatch.setenv("WRAP_LOG", str(log))
    report = pytester.path / "r.json"
    # a subprocess: modules the gates import (torch's operator registrations) must not be
    # dropped and imported again in this process, as pytester's in-process runs do
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    result = pytester.runpytest_subprocess(
        "-p",
        "wrapping_plugin",
        "--pyargs",
        "dflash_suites",
        "-m",
        "ppl",
        "-k",
        "heldout_segments",
        "--dflash-route",
        "prefill.geometry.fp16_q7920",
        "--dflash-profile",
        "quick",
        "--dflash-data",
        str(data),
        "--dflash-report",
        str(report),
        "-p",
        "no:cacheprovider",
    )
    gate = json.loads(report.read_text())["routes"]["prefill.geometry.fp16_q7920"]["gates"]["ppl"]
    assert gate["status"] == "passed", gate["tests"][0]["message"]
    # both engines the gate used are the wrappers: each scored the two segments
    assert json.loads(log.read_text()) == {
        "prefill.geometry.fp32_q3296": 2,
        "prefill.geometry.fp16_q7920": 2,
    }
    assert result.ret == pytest.ExitCode.OK, result.outlines[-20:]


def test_default_engine_refuses_an_unknown_route(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import pytest_dflash\n"
        "def test_x(pytestconfig):\n"
        "    pytest_dflash.default_engine(pytestconfig, {'prefill.geometry': 'nope'})\n"
    )
    pytester.makepyfile(test_x="from conftest import test_x\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*unknown route 'nope'; known routes:*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
