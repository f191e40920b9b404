"""The llama.cpp job's gate command selects every gate kind the llama.cpp routes declare.

The job (``.ci/llamacpp``) and the script that writes its result file
(``benchmarks/llamacpp_gates.py``) pick the gate tests with ``-m``. A kind a route requires but
the expression leaves out never runs, so that gate stays pending for "nothing selected" instead
of giving its own verdict or reason; nothing else notices, since the job is informational. This
runs without llama-cpp-python: it reads the commands, not a server.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pytest_dflash.engines import llamacpp as lc
from pytest_dflash.routes.vocabulary import GATE_KINDS

ROOT = Path(__file__).resolve().parent.parent


def selected_kinds(expression: str) -> set[str]:
    """The gate kinds a ``-m`` expression of ``or``-ed kind markers selects; anything else in it
    (``and``, ``not``, parentheses, another marker) fails the test, naming it."""
    words = expression.split(" or ")
    unknown = [w for w in words if w not in GATE_KINDS]
    assert not unknown, f"-m {expression!r}: {unknown} are not gate kinds ({GATE_KINDS})"
    return set(words)


def declared_kinds() -> set[str]:
    return {kind for route in lc.LLAMACPP_ROUTES for kind in route.gates}


def test_the_ci_job_selects_every_kind_the_routes_declare() -> None:
    script = (ROOT / ".ci" / "llamacpp").read_text(encoding="utf-8")
    found = re.findall(r'--pyargs dflash_suites -m "([^"]+)"', script)
    assert len(found) == 1, f".ci/llamacpp: expected one gate command, found {found}"
    missing = declared_kinds() - selected_kinds(found[0])
    assert not missing, f".ci/llamacpp: -m {found[0]!r} leaves out the gate kinds {missing}"


def test_the_result_script_selects_every_kind_the_routes_declare() -> None:
    tree = ast.parse((ROOT / "benchmarks" / "llamacpp_gates.py").read_text(encoding="utf-8"))
    expressions = [
        items[i + 1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.List)
        for items in [node.elts]
        for i in range(len(items) - 1)
        if isinstance(items[i], ast.Constant) and items[i].value == "-m"
        and isinstance(items[i + 1], ast.Constant) and items[i + 1].value != "pytest"
    ]  # the marker expression of the command list (python -m pytest aside)
    assert len(expressions) == 1, f"llamacpp_gates.py: expected one -m, found {expressions}"
    missing = declared_kinds() - selected_kinds(expressions[0])
    assert not missing, f"llamacpp_gates.py: -m {expressions[0]!r} leaves out {missing}"
