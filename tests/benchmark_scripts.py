"""The scripts of ``benchmarks/`` as modules, for the tests that run them (benchmarks/ is no
package: each script is run by its path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported from its file."""
    spec = importlib.util.spec_from_file_location(f"dflash_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
