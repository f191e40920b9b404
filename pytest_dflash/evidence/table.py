"""Plain-text verdict table, shared by the terminal summary and the CLI."""

from __future__ import annotations

from typing import Any

from pytest_dflash.evidence.catch import marks, summarize
from pytest_dflash.evidence.report import judged
from pytest_dflash.evidence.verdict import gate_outcome
from pytest_dflash.routes.vocabulary import GATE_KINDS

_MARK = {"passed": "pass", "failed": "FAIL", "pending": "pending", "inconclusive": "inconcl",
         "error": "ERROR"}


def render(report: dict[str, Any]) -> list[str]:
    """One row per candidate route, gate columns, then the deciding figure of each gate.

    Routes planted by the self-test are judged like any route but shown in its own table
    (``pytest_dflash.evidence.catch.render``); a gate whose self-test missed a planted defect
    is marked ``!`` here, because its accept is not evidence."""
    routes = judged(report["routes"])
    unproven = marks(summarize(report))
    if not routes:
        return ["no candidate routes were registered or selected"]
    kinds = [k for k in GATE_KINDS if any(k in r["required"] for r in routes.values())]
    name_w = max(len("route"), *(len(n) for n in routes))
    widths = [max(len(k), 7) for k in kinds]
    columns = [k.ljust(w) for k, w in zip(kinds, widths, strict=True)]
    header = "  ".join(["route".ljust(name_w), *columns, "verdict"])
    lines = [header, "-" * len(header)]
    for name, entry in sorted(routes.items()):
        cells = []
        for kind, width in zip(kinds, widths, strict=False):
            gate = entry["gates"].get(kind)
            mark = "-" if gate is None else _MARK[gate_outcome(gate)]
            cells.append((mark + ("!" if (name, kind) in unproven else "")).ljust(width))
        lines.append("  ".join([name.ljust(name_w), *cells, entry["verdict"].upper()]))
        for kind in kinds:
            gate = entry["gates"].get(kind)
            if gate and gate.get("figure"):
                lines.append(f"    {kind}: {gate['figure']}")
        lines.extend(f"    -> {reason}" for reason in entry["reasons"])
        lines.extend(f"    -> {unproven[(name, kind)]}" for kind in kinds
                     if (name, kind) in unproven)
    return lines
