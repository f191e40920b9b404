"""The package layout shows the architecture, and keeps showing it.

Every module lives in a subpackage with one job (or is ``plugin.py``, ``settings.py`` or the
package ``__init__``); docs/architecture.md draws exactly that tree; options are read in one
module; the evidence never imports the self-test; and no two modules import each other round a
circle. Each rule is checked on the real source tree, so a move that breaks one fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pytest_dflash"
TOP_LEVEL = {"__init__.py", "plugin.py", "settings.py"}
# evaluate metric modules: loaded by path through `evaluate`, not imported as package modules
METRIC_SCRIPTS = ("metrics/pass_at_k", "metrics/perplexity")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(METRIC_SCRIPTS):
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports, anywhere in it (a lazy import is still a link)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in modules and name != "pytest_dflash"}


def test_every_module_belongs_to_a_subpackage() -> None:
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in TOP_LEVEL]
    assert not loose, f"modules outside any subpackage: {loose}; move each where its job is"


def test_architecture_draws_the_package_tree() -> None:
    """docs/architecture.md lists every module of the package, and nothing that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text[text.index("pytest_dflash/\n"):text.index("kernels/ (dflash_kernels)")]
    drawn, folder = set(), ""
    for line in block.splitlines()[1:]:
        match = re.match(r"^( +)([\w.]+/?)\s", line + " ")
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        if indent == 2 and name.endswith("/"):
            folder = name
        elif indent == 2:
            folder = ""
            drawn.add(name)
        elif indent == 4 and name.endswith(".py"):
            drawn.add(folder + name)
        elif indent == 4:
            drawn.add(folder + name)  # report.schema.json
    real = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if not p.relative_to(PACKAGE).as_posix().startswith(METRIC_SCRIPTS)}
    real |= {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.json")}
    undrawn = sorted(m for m in real - drawn
                     if not m.endswith(("__init__.py", "__main__.py")) or m == "__init__.py"
                     or m in ("engines/__init__.py", "metrics/__init__.py"))
    assert not undrawn, f"docs/architecture.md does not draw: {undrawn}"
    gone = sorted(drawn - real)
    assert not gone, f"docs/architecture.md draws modules that do not exist: {gone}"


def test_only_the_settings_module_reads_options() -> None:
    readers = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if p != PACKAGE / "settings.py"
               and re.search(r"\b(getoption|getini)\(", p.read_text(encoding="utf-8"))]
    assert not readers, f"read options outside pytest_dflash/settings.py: {readers}"


def test_the_evidence_does_not_import_the_selftest() -> None:
    modules = _modules()
    leaks = {name: sorted(i for i in _imports(path, modules) if ".selftest" in i)
             for name, path in modules.items() if name.startswith("pytest_dflash.evidence")}
    leaks = {name: found for name, found in leaks.items() if found}
    assert not leaks, f"evidence modules import the self-test: {leaks}"


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name)):
            raise AssertionError("import circle: " + " -> ".join(circle))
