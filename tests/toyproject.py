"""A pytester project of a toy family, as the plugin's session tests build it.

A toy family keeps a test about the plugin's session (outcomes, verdicts, the report) to what
it is about: its ``conftest.py`` registers the family, routes and engine; its modules hold the
gate tests and the routes' implementations, importable by name (``impl="toyimpl:..."``).
"""

from __future__ import annotations

import pytest


def toy_project(pytester: pytest.Pytester, conftest: str, **modules: str) -> pytest.Pytester:
    """Write ``conftest.py`` and each module (name -> source) and put the folder on sys.path."""
    pytester.makeconftest(conftest)
    pytester.makepyfile(**modules)
    pytester.syspathinsert()
    return pytester
