"""Verdict summaries of a report in three formats: text, Markdown, JSON.

Why: the same evidence is read by a person in a terminal (text), by reviewers in a pull-request
comment or a CI job summary such as ``$GITHUB_STEP_SUMMARY`` (Markdown), and by other tools
(JSON). All three are derived from the report's routes only, never from anything else, so they
cannot disagree with each other or with ``pytest-dflash verdict``'s exit status.
"""

from __future__ import annotations

import json
from typing import Any

from pytest_dflash.evidence.report import judged
from pytest_dflash.evidence.table import render
from pytest_dflash.evidence.verdict import gate_outcome

FORMATS: tuple[str, ...] = ("text", "markdown", "json")
SUMMARY_SCHEMA = "pytest-dflash/summary/1"
_MD_STATUS = {"passed": "pass", "failed": "**FAIL**", "pending": "pending",
              "inconclusive": "*inconclusive*", "error": "**ERROR**"}
_MD_VERDICT = {"accept": "ACCEPT", "reject": "**REJECT**", "pending": "*PENDING*"}


def all_accepted(report: dict[str, Any]) -> bool:
    """True iff there is at least one candidate and every one is accepted (the exit-0 rule)."""
    verdicts = [entry["verdict"] for entry in judged(report["routes"]).values()]
    return bool(verdicts) and all(v == "accept" for v in verdicts)


def context_line(report: dict[str, Any]) -> str:
    """Where the evidence comes from: profile, device, code fingerprint, time."""
    from pytest_dflash.evidence import fingerprint
    device = report.get("device", {}).get("name") or "unknown device"
    return (f"profile {report['profile']}, device {device}, fingerprint "
            f"{fingerprint.short(report.get('fingerprint', {}))}, created {report['created']}")


def shards_line(report: dict[str, Any]) -> str | None:
    """Where a merged report's evidence comes from: its shards, hosts, and any that never
    arrived (``pytest-dflash merge``); None for the report of one run."""
    shards = report.get("shards")
    if not shards:
        return None
    merged = shards["merged"]
    count = shards.get("count")
    taken = ", ".join(f"{m['shard']}/{count}" if m.get("shard") else m["file"] for m in merged)
    hosts = sorted({m["host"] for m in merged if m.get("host")})
    line = f"merged from {len(merged)} reports ({taken})"
    if hosts:
        line += f" on {len(hosts)} host{'s' if len(hosts) > 1 else ''} ({', '.join(hosts)})"
    if shards["missing"]:
        line += "; never arrived: " + ", ".join(f"shard {k}/{count}" for k in shards["missing"])
    return line


def counts(report: dict[str, Any]) -> dict[str, int]:
    """How many candidates got each verdict."""
    result = {"accept": 0, "reject": 0, "pending": 0}
    for entry in judged(report["routes"]).values():
        result[entry["verdict"]] = result.get(entry["verdict"], 0) + 1
    return result


def to_text(report: dict[str, Any]) -> str:
    """The terminal table (the same as the pytest run prints), headed by its context."""
    shards = shards_line(report)
    head = [context_line(report)] + ([shards] if shards else [])
    return "\n".join([*head, *render(report)]) + "\n"


def _md_cell(text: str, limit: int = 300) -> str:
    """A table cell: one line, ``|`` escaped, long figures shortened."""
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def to_markdown(report: dict[str, Any]) -> str:
    """A Markdown summary for a PR comment or ``$GITHUB_STEP_SUMMARY``.

    A headline with the counts, the verdict table (one row per candidate, one column per gate
    kind that any candidate requires), then per route the deciding figures and the reasons a
    candidate is not accepted. GitHub renders it as is; nothing in it needs HTML except the
    collapsible figure list, which degrades to plain text elsewhere.
    """
    from pytest_dflash.routes.vocabulary import GATE_KINDS

    routes = judged(report["routes"])
    tally = counts(report)
    state = "all candidates accepted" if all_accepted(report) else "not all candidates accepted"
    lines = [
        "## pytest-dflash verdicts",
        "",
        f"**{state}**: {tally['accept']} accepted, {tally['reject']} rejected, "
        f"{tally['pending']} pending. {_md_cell(context_line(report))}",
        "",
    ]
    if shards_line(report):
        lines[-1:-1] = ["", f"Evidence {_md_cell(shards_line(report) or '')}."]
    if not routes:
        return "\n".join([*lines, "No candidate routes were registered or selected.", ""])
    kinds = [k for k in GATE_KINDS if any(k in r["required"] for r in routes.values())]
    lines.append("| route | " + " | ".join(kinds) + " | verdict |")
    lines.append("|---|" + "---|" * len(kinds) + "---|")
    for name, entry in sorted(routes.items()):
        cells = []
        for kind in kinds:
            gate = entry["gates"].get(kind)
            cells.append("-" if gate is None else _MD_STATUS[gate_outcome(gate)])
        verdict = _MD_VERDICT.get(entry["verdict"], entry["verdict"])
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {verdict} |")
    lines.append("")
    reasons = [(n, e) for n, e in sorted(routes.items()) if e["reasons"]]
    if reasons:
        lines.append("### Why not accepted")
        lines.append("")
        for name, entry in reasons:
            for reason in entry["reasons"]:
                lines.append(f"- `{name}`: {_md_cell(reason)}")
        lines.append("")
    lines.append("<details><summary>Figures per gate</summary>")
    lines.append("")
    lines.append("| route | gate | status | figure |")
    lines.append("|---|---|---|---|")
    for name, entry in sorted(routes.items()):
        for kind in kinds:
            gate = entry["gates"].get(kind)
            if gate is not None:
                lines.append(f"| `{name}` | {kind} | {gate_outcome(gate)} | "
                             f"{_md_cell(gate.get('figure') or '-')} |")
    lines.extend(["", "</details>", ""])
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> dict[str, Any]:
    """A small machine-readable summary: verdicts, reasons, gate statuses and figures."""
    from pytest_dflash.evidence import fingerprint
    return {
        "schema": SUMMARY_SCHEMA,
        "accepted": all_accepted(report),
        "counts": counts(report),
        "profile": report["profile"],
        "device": report.get("device", {}).get("name"),
        "fingerprint": fingerprint.short(report.get("fingerprint", {})),
        "created": report["created"],
        "shards": shards_line(report),
        "routes": {
            name: {
                "verdict": entry["verdict"],
                "switch": entry.get("switch"),
                "reasons": list(entry["reasons"]),
                "gates": {kind: {"status": gate["status"], "outcome": gate_outcome(gate),
                                 "figure": gate.get("figure", "")}
                          for kind, gate in entry["gates"].items()},
            }
            for name, entry in sorted(judged(report["routes"]).items())
        },
    }


def render_summary(report: dict[str, Any], fmt: str) -> str:
    """The summary in ``fmt`` (one of FORMATS) as text ready to print."""
    if fmt == "text":
        return to_text(report)
    if fmt == "markdown":
        return to_markdown(report)
    if fmt == "json":
        return json.dumps(to_json(report), indent=2) + "\n"
    raise ValueError(f"unknown summary format {fmt!r}; use one of {', '.join(FORMATS)}")
