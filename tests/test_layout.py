"""The package layout shows the architecture, and keeps showing it.

Every module lives in a subpackage with one job (or is ``plugin.py``, ``settings.py`` or the
package ``__init__``); docs/architecture.md draws exactly that tree; options are read in one
module; no two modules import each other round a circle, and neither do two subpackages; and
every import, lazy or not, points down the documented layers (docs/architecture.md, "Layers"):
ground (routes, policy, native, sandbox), then measure, engines, metrics, then evidence and
settings, then session, selftest, xdist, then plugin, cli and the public package API. Each rule
is checked on the real source tree, so a move that breaks one fails here.
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
# the documented direction, lowest first: a package may import its own layer's packages (without
# a circle) and the layers below, never one above. "" is the package API (pytest_dflash/__init__).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"routes", "policy", "native", "sandbox", "library"}),
    frozenset({"measure", "engines", "metrics"}),
    frozenset({"evidence", "settings"}),
    frozenset({"session", "selftest", "xdist"}),
    frozenset({"plugin", "cli", ""}),
)


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


def test_only_the_settings_module_touches_config_option() -> None:
    """``config.option`` (read or written, xdist's options too) only in settings.py."""
    touching = sorted(
        f"{p.relative_to(ROOT)}:{node.lineno}" for p in PACKAGE.rglob("*.py")
        if p != PACKAGE / "settings.py"
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr == "option")
    assert not touching, f"config.option outside pytest_dflash/settings.py: {touching}"


def _package(module: str) -> str:
    """The subpackage (or top-level module) ``module`` belongs to; "" for the package API."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the module imports that make the edge."""
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(_package(name), {})
        for imported in sorted(_imports(path, modules)):
            if _package(imported) != _package(name):
                edges.setdefault(_package(imported), []).append(f"{name} -> {imported}")
    return graph


def _layer(package: str) -> int:
    for level, members in enumerate(LAYERS):
        if package in members:
            return level
    raise AssertionError(f"package {package or 'pytest_dflash'} is in no layer; add it to "
                         "LAYERS here and to the layers of docs/architecture.md")


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (node -> nodes it points to), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name)):
            return circle
    return None


def test_the_imports_find_lazy_and_module_imports() -> None:
    """The graph reader sees what the layer rules rely on: an import inside a function, and a
    module imported by ``from package import module``."""
    modules = _modules()
    found = _imports(PACKAGE / "__init__.py", modules)
    assert "pytest_dflash.session.engine_factory" in found  # inside default_engine()
    assert "pytest_dflash.routes.hookspec" in _imports(PACKAGE / "plugin.py", modules)


def test_no_import_circle_between_modules() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_no_import_circle_between_packages() -> None:
    graph = _package_graph()
    circle = _circle({package: set(edges) for package, edges in graph.items()})
    assert circle is None, (
        "package import circle: " + " -> ".join(circle or []) + "; the edges: "
        + "; ".join(e for a, b in zip(circle or [], (circle or [])[1:], strict=False)
                    for e in graph[a].get(b, [])))


def test_every_import_points_down_the_layers() -> None:
    upward = [edge for package, edges in sorted(_package_graph().items())
              for target, found in sorted(edges.items()) if _layer(target) > _layer(package)
              for edge in found]
    assert not upward, ("imports against the layers of docs/architecture.md (pass the value "
                        "down as an argument, or move the shared part to a lower layer): "
                        + "; ".join(upward))


def test_measurement_and_evidence_know_neither_session_nor_selftest() -> None:
    graph = _package_graph()
    leaks = [edge for package in ("measure", "evidence") for target in ("session", "selftest")
             for edge in graph.get(package, {}).get(target, [])]
    assert not leaks, f"measurement or evidence imports the session or the self-test: {leaks}"


def test_the_architecture_page_states_the_layers() -> None:
    """docs/architecture.md names the same layers, in the same order, as LAYERS here."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text[text.index("## Layers"):]
    rows = re.findall(r"^\d\. (.+)$", block, flags=re.M)[:len(LAYERS)]
    drawn = [frozenset(n.strip("`/").removesuffix(".py").replace("__init__", "")
                       for n in re.findall(r"`([^`]+)`", row)) for row in rows]
    assert drawn == list(LAYERS), (
        f"docs/architecture.md's layers {drawn} differ from the tested ones {list(LAYERS)}")
