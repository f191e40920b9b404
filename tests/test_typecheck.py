"""The type checker runs over the package and finds nothing (configuration: pyproject's
[tool.mypy]), so an annotation that stops holding fails the tests, not a user."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error_in_the_package(tmp_path: Path) -> None:
    assert importlib.util.find_spec("mypy") is not None, (
        "mypy is not installed; it is in the test extra: pip install -e '.[test]'")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "pytest_dflash", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"mypy pytest_dflash:\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout, done.stdout
