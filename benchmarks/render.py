"""Render docs/benchmarks.md from the committed result files in benchmarks/results/.

Every measured figure the documentation shows lives in a result file (``*.json``, schema
``pytest-dflash/benchmark/1``) that says where it was measured (machine, Python, torch/CUDA),
on which commit, by which command, and holds the values as one table. Figures in prose cannot
be checked or regenerated; a file can, and the page made from it is checked against it by
``tests/test_docs.py``.

    python benchmarks/render.py            # rewrite docs/benchmarks.md and the embedded tables
    python benchmarks/render.py --check    # exit 1 if any of them is stale

A page of ``docs/`` that discusses a figure embeds its file's table where it discusses it, in a
block the script fills (and ``--check`` checks) like the benchmarks page::

    <!-- results: h100-timing-aa-validation-cost.json -->
    <!-- /results -->

A result file holds::

    {"schema": "pytest-dflash/benchmark/1",
     "kind": "measured" | "not kept",        # "not kept": columns approach / figure / why not kept
     "topic": "QPN kernels", "title": "...", "about": "what the figures are, in a sentence or two",
     "machine": "...", "python": "...", "torch": "...", "cuda": "13.0" | null,
     "commit": "<short hash>" | ["...", ...], "date": "2026-12-02", "command": "...",
     "values": {"columns": ["...", ...], "rows": [["...", ...], ...]}}

``values`` is a table (``columns`` and ``rows``) or, for a script that writes its figures as a
nested record, any other JSON object: that is rendered as one row per leaf, its path and value.
A "not kept" file is always a table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
DOCS = ROOT / "docs"
EMBED = re.compile(r"(<!-- results: (?P<name>[\w.-]+\.json) -->\n)(?P<body>.*?)(<!-- /results -->)",
                   re.DOTALL)
SCHEMA = "pytest-dflash/benchmark/1"
KINDS = ("measured", "not kept")
NOT_KEPT_COLUMNS = ["approach", "figure", "why not kept"]
# Topics in page order; a topic not listed here comes after them, in alphabetical order.
TOPICS = ("main job", "timing error rates", "QPN kernels", "D256 attention",
          "validation_cost on the CPU", "multi-GPU")
TEXT_FIELDS = ("topic", "title", "about", "machine", "python", "torch", "date", "command")

HEADER = """\
# Benchmarks and measured figures

<!-- Rendered by `python benchmarks/render.py` from benchmarks/results/*.json: do not edit. -->

Every figure these pages quote comes from a result file in `benchmarks/results/`, which records
the machine, Python, torch and CUDA, the commit, the command and the values. Edit the result
file, then run `python benchmarks/render.py`; `tests/test_docs.py` fails while this page is
stale. Timing figures on a shared CPU are noisy: the machine line says so where it was shared.
Each topic ends with what was tried and not kept.
"""


class ResultFileError(ValueError):
    """A result file that cannot be rendered; the message names the file, the field and the fix."""


def _fail(path: Path, problem: str) -> ResultFileError:
    return ResultFileError(
        f"{path.name}: {problem} (fix the file; the fields are listed in benchmarks/render.py)"
    )


def _check(path: Path, data: Any) -> dict[str, Any]:
    """Return ``data`` if it is a well-formed result file, else raise naming what is wrong."""
    if not isinstance(data, dict):
        raise _fail(path, "the file must hold one JSON object")
    if data.get("schema") != SCHEMA:
        raise _fail(path, f"'schema' must be {SCHEMA!r}, found {data.get('schema')!r}")
    if data.get("kind") not in KINDS:
        raise _fail(path, f"'kind' must be one of {KINDS}, found {data.get('kind')!r}")
    for field in TEXT_FIELDS:
        if not isinstance(data.get(field), str) or not data[field].strip():
            raise _fail(path, f"'{field}' must be a non-empty string")
    if data.get("cuda") is not None and not isinstance(data["cuda"], str):
        raise _fail(path, "'cuda' must be a string, or null where no GPU was used")
    commit = data.get("commit")
    commits = [commit] if isinstance(commit, str) else commit
    if (
        not isinstance(commits, list)
        or not commits
        or not all(isinstance(c, str) and c.strip() for c in commits)
    ):
        raise _fail(path, "'commit' must be a commit id or a non-empty list of them")
    values = data.get("values")
    if not isinstance(values, dict) or not values:
        raise _fail(path, "'values' must be a non-empty object: a table or a record")
    if "columns" not in values and "rows" not in values:
        if data["kind"] == "not kept":
            raise _fail(path, f"a 'not kept' file holds a table: columns {NOT_KEPT_COLUMNS}")
        return data  # a record: rendered leaf by leaf
    columns, rows = values.get("columns"), values.get("rows")
    if not isinstance(columns, list) or not columns or not all(isinstance(c, str) for c in columns):
        raise _fail(path, "'values.columns' must be a non-empty list of strings")
    if data["kind"] == "not kept" and columns != NOT_KEPT_COLUMNS:
        raise _fail(path, f"a 'not kept' table has the columns {NOT_KEPT_COLUMNS}")
    if not isinstance(rows, list) or not rows:
        raise _fail(path, "'values.rows' must be a non-empty list of rows")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, list) or len(row) != len(columns):
            raise _fail(
                path, f"row {number} must be a list of {len(columns)} cells, one per column"
            )
        if not all(isinstance(cell, str | int | float) for cell in row):
            raise _fail(path, f"row {number}: every cell must be a string or a number")
    return data


def load(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every result file under ``results``, checked, in file-name order."""
    paths = sorted(results.glob("*.json"))
    if not paths:
        raise ResultFileError(f"no result files (*.json) in {results}")
    loaded = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise _fail(path, f"not valid JSON: {exc}") from None
        loaded.append({**_check(path, data), "_file": path.name})
    return loaded


def _text(value: Any) -> str:
    """A cell's text: floats to 6 significant digits (the file keeps every digit)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    return str(value)


def _cell(value: Any) -> str:
    return _text(value).replace("|", "\\|").replace("\n", " ")


def _leaves(value: Any, path: str = "") -> list[list[str]]:
    """(path, value) rows of a nested record; a list of scalars stays one value."""
    if isinstance(value, dict):
        return [
            row
            for key, item in value.items()
            for row in _leaves(item, f"{path}.{key}" if path else str(key))
        ]
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return [row for i, item in enumerate(value) for row in _leaves(item, f"{path}[{i}]")]
    return [[path, _text(value)]]


def _values(values: dict[str, Any]) -> list[str]:
    if "columns" in values:
        return _table(values["columns"], values["rows"])
    return _table(["field", "value"], _leaves(values))


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _section(data: dict[str, Any]) -> list[str]:
    commit = data["commit"]
    commits = ", ".join(f"`{c}`" for c in ([commit] if isinstance(commit, str) else commit))
    cuda = data["cuda"] or "none (CPU)"
    return [
        f"### {data['title']}",
        "",
        data["about"],
        "",
        f"- machine: {data['machine']}",
        f"- Python {data['python']}; torch {data['torch']}; CUDA {cuda}",
        f"- commit: {commits}; date: {data['date']}",
        f"- command: `{data['command']}`",
        "",
        *_values(data["values"]),
        "",
    ]


def _topic_key(topic: str) -> tuple[int, str]:
    return (TOPICS.index(topic), "") if topic in TOPICS else (len(TOPICS), topic)


def render(results: list[dict[str, Any]]) -> str:
    """The Markdown page for ``results``: topics in TOPICS order, measured before not kept."""
    lines = [HEADER]
    for topic in sorted({r["topic"] for r in results}, key=_topic_key):
        lines += [f"## {topic}", ""]
        of_topic = [r for r in results if r["topic"] == topic]
        for kind in KINDS:
            for data in of_topic:
                if data["kind"] == kind:
                    lines += _section(data)
    return "\n".join(lines).rstrip("\n") + "\n"


def embedded(text: str, results: list[dict[str, Any]], page: Path) -> str:
    """``text`` with every ``<!-- results: NAME.json -->`` block filled from that result file
    (its description, machine, command and table; the heading, commit and date stay on the
    benchmarks page)."""
    by_name = {r["_file"]: r for r in results}

    def fill(match: re.Match[str]) -> str:
        data = by_name.get(match["name"])
        if data is None:
            raise ResultFileError(f"{page}: embeds {match['name']}, which is not a result file "
                                  f"in benchmarks/results/; fix the name or add the file")
        # the docs speak of the product: the commit and date stay on the benchmarks page
        lines = [line for line in _section(data)[2:] if not line.startswith("- commit: ")]
        body = "\n".join(lines).rstrip("\n") + "\n"
        return match.group(1) + body + match.group(4)

    return EMBED.sub(fill, text)


def pages(results: list[dict[str, Any]], page: Path, docs: Path) -> dict[Path, str]:
    """Every page the files render: the benchmarks page and each doc page with embeds."""
    out = {page: render(results)}
    for doc in sorted(docs.glob("*.md")):
        if doc.resolve() == page.resolve():
            continue
        text = doc.read_text(encoding="utf-8")
        if EMBED.search(text):
            out[doc] = embedded(text, results, doc)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if docs/benchmarks.md differs from what the files render",
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files' folder")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the pages that embed tables")
    args = parser.parse_args(argv)
    try:
        rendered = pages(load(args.results), args.page, args.docs)
    except ResultFileError as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 2
    if args.check:
        stale = [path for path, text in rendered.items()
                 if (path.read_text(encoding="utf-8") if path.exists() else "") != text]
        for path in stale:
            print(f"render: {path} is stale: run `python benchmarks/render.py`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in rendered.items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
