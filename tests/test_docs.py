"""The documentation: it cites only what the repository holds (every relative link and every
backticked repository path in README.md, CHANGELOG.md and docs/ names a file or folder that
exists), the README is for users, its figures come from result files, it speaks of the product
rather than of how it was built, and it builds as a site."""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from benchmark_scripts import script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = (
    "pytest_dflash",
    "kernels",
    "suites",
    "fixtures",
    "docs",
    "tests",
    "scripts",
    "benchmarks",
    ".ci",
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a backticked path under one of the top folders, e.g. `kernels/csrc/qpn_gemm.cpp`
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)")


def _targets(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text(encoding="utf-8")
    found = []
    for link in LINK.findall(text):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue  # a URL or an anchor in the same page
        found.append((link, doc.parent / link.split("#")[0]))
    for path in PATH.findall(text):
        found.append((path, ROOT / path.rstrip(".")))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_cited_file_exists(doc: Path) -> None:
    missing = [cited for cited, path in _targets(doc) if not path.exists()]
    assert not missing, (
        f"{doc.relative_to(ROOT)} cites what the repository does not hold: {missing}"
    )


# --------------------------------------------------------------------------- README for users

README = ROOT / "README.md"


def _readme_lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def test_readme_is_short_and_gets_to_gating_a_route_early() -> None:
    lines = _readme_lines()
    assert len(lines) <= 250, (
        f"README.md has {len(lines)} lines; keep it at most 250 (the rest belongs in docs/)"
    )
    heading = [n for n, line in enumerate(lines, 1) if line == "## Gate your own route"]
    assert heading and heading[0] <= 120, (
        "README.md must reach '## Gate your own route' within "
        f"its first 120 lines (found at {heading})"
    )


def test_readme_starts_with_the_two_commands() -> None:
    """.ci/run and readers take the two commands from lines 3-6: the main job, then the tests."""
    lines = _readme_lines()
    assert lines[2] == "```bash" and lines[5] == "```", "lines 3 and 6 must fence the commands"
    assert lines[3].endswith("pip install -e . && pytest -m sm70"), lines[3]
    assert lines[4].endswith("pip install -e '.[test]' && pytest tests -n auto --dist worksteal"), \
        lines[4]
    for line in lines[3:5]:
        assert "pip install torch==2.13.0" in line, "the CPU wheel of torch is installed first"


def _readme_plugin() -> str:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(# mine_routes\.py\n.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1, "README.md must hold one ```python block starting '# mine_routes.py'"
    return blocks[0]


def test_readme_outside_plugin_is_gated_by_the_shipped_parity_suite(
    pytester: pytest.Pytester,
) -> None:
    """The README's outside plugin, as printed, passes the shipped parity gate (its speed gate
    does not run here, so the route stays pending, never accepted on parity alone)."""
    pytester.makepyfile(mine_routes=_readme_plugin())
    pytester.syspathinsert()
    report = pytester.path / "readme-report.json"
    result = pytester.runpytest(
        "-p",
        "mine_routes",
        "--pyargs",
        "dflash_suites",
        "-m",
        "parity",
        "--dflash-route",
        "attn.d256.mine",
        "--dflash-profile",
        "quick",
        "--dflash-report",
        str(report),
        "-p",
        "no:cacheprovider",
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["attn.d256.mine*pass*PENDING*"])
    tests = json.loads(report.read_text())["routes"]["attn.d256.mine"]["gates"]["parity"]["tests"]
    assert len(tests) >= 4 and all(t["outcome"] == "passed" for t in tests)


# ------------------------------------------------------------------------ figures as data


def _render_module():
    return script("render")


def test_benchmarks_page_is_rendered_from_the_result_files() -> None:
    render = _render_module()
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == render.render(render.load()), (
        "docs/benchmarks.md is stale: run `python benchmarks/render.py` and commit the page"
    )
    rendered = render.pages(render.load(), render.PAGE, render.DOCS)
    for path, text in rendered.items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is stale: run `python benchmarks/render.py` and commit the page")


def test_a_page_embeds_a_result_table_that_render_fills_and_checks(tmp_path: Path) -> None:
    render = _render_module()
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "gates.md"
    page.write_text(
        "# Gates\n\n<!-- results: cpu-main-job.json -->\nSTALE-TEXT\n<!-- /results -->\n")
    args = ["--docs", str(docs), "--page", str(docs / "benchmarks.md")]
    assert render.main(["--check", *args]) == 1  # the stale text is not the file's table
    assert render.main(args) == 0
    text = page.read_text()
    data = json.loads((ROOT / "benchmarks" / "results" / "cpu-main-job.json").read_text())
    assert "| " + " | ".join(data["values"]["columns"]) + " |" in text and "STALE-TEXT" not in text
    assert data["about"] in text and "- commit:" not in text
    assert text.startswith("# Gates") and text.rstrip().endswith("<!-- /results -->")
    assert render.main(["--check", *args]) == 0
    page.write_text("<!-- results: no-such-file.json -->\n<!-- /results -->\n")
    assert render.main(["--check", *args]) == 2


def test_render_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    render = _render_module()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    page = tmp_path / "benchmarks.md"
    docs = ["--docs", str(tmp_path)]  # no page of the checkout is written
    assert render.main(["--results", str(results), "--page", str(page), *docs]) == 0
    assert render.main(["--check", "--results", str(results), "--page", str(page), *docs]) == 0
    one = results / "cpu-main-job.json"
    data = json.loads(one.read_text())
    data["values"]["rows"][0][2] = "ratio 0.500 [0.400, 0.600]"
    one.write_text(json.dumps(data))
    assert render.main(["--check", "--results", str(results), "--page", str(page), *docs]) == 1


def test_render_names_the_file_and_field_of_a_malformed_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    render = _render_module()
    data = json.loads((ROOT / "benchmarks" / "results" / "cpu-main-job.json").read_text())
    del data["commit"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    assert render.main(["--check", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "'commit'" in err and "fix the file" in err


def test_every_result_file_says_where_and_how_it_was_measured() -> None:
    for data in _render_module().load():
        for field in ("machine", "torch", "commit", "command", "date"):
            assert data[field], f"{data['title']}: empty {field}"


# ----------------------------------------------------------- no development-process words

# What a user does not need: how the project was built. "session" is allowed where it is a
# pytest session; the patterns below name the other senses.
PROCESS_WORDS = [
    (re.compile(r"\b[Ss]tops? \d+\b"), "a numbered development round"),
    (re.compile(r"\bwhat the \w+ round measured\b", re.IGNORECASE), "a development round"),
    (
        re.compile(
            r"\b(?:earlier|previous|next|later|same|last|development|dev) sessions?\b",
            re.IGNORECASE,
        ),
        "a development session",
    ),
    (re.compile(r"\bsessions? \d+\b", re.IGNORECASE), "a numbered session"),
    (
        re.compile(
            r"\b(?:GPU|device)[- ](?:time )?budget\b|\bdevice time (?:ran out|left)\b",
            re.IGNORECASE,
        ),
        "a GPU budget",
    ),
    (
        re.compile(
            r"\bdev(?:elopment)? (?:machine|box|venv|host|image)\b"
            r"|\b(?:that|this|the H200) image\b",
            re.IGNORECASE,
        ),
        "the build environment",
    ),
    (re.compile(r"/(?:work|Users)/|/home/[a-z]|/root/\."), "an absolute path of a build machine"),
]
# a commit hash in prose (7-40 hex digits with a letter and a digit): a diary of commits
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
SOURCE_DIRS = ("pytest_dflash", "kernels", "suites", "benchmarks", "fixtures")


def _markdown_prose(text: str) -> str:
    """The text outside fenced code blocks (example output may hold hashes of libraries)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _python_words(path: Path) -> str:
    """The comments and docstrings of a Python file: what it says, not what it runs."""
    source = path.read_text(encoding="utf-8")
    parts = [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


def _c_comments(path: Path) -> str:
    return "\n".join(
        re.findall(r"//[^\n]*|/\*.*?\*/", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    )


def _scanned() -> list[tuple[Path, str, bool]]:
    """(file, its words, whether hashes count) for every file the rule covers."""
    found = []
    for doc in [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        found.append(
            (doc, _markdown_prose(doc.read_text(encoding="utf-8")), doc.name != "benchmarks.md")
        )  # its commit lines are data, by design
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix == ".py":
                found.append((path, _python_words(path), True))
            elif path.suffix in (".cpp", ".cu", ".h", ".cuh"):
                found.append((path, _c_comments(path), True))
    return found


def _process_words(text: str, hashes: bool) -> list[str]:
    hits = [
        f"{why}: {m.group(0)!r}" for pattern, why in PROCESS_WORDS for m in pattern.finditer(text)
    ]
    if hashes:
        hits += [f"a commit hash: {m.group(0)!r}" for m in HASH.finditer(text)]
    return hits


def test_the_scan_finds_development_process_words() -> None:
    """The rule below can fail: each kind of word it exists for is found in a sample."""
    # the sample is assembled from pieces, so that this file itself holds none of the words
    pieces = (
        ("Since", "st" + "op", "27 the kernel is faster (com" + "mit", "9ca6" + "d11); an"),
        ("earl" + "ier", "sess" + "ion", "measured it on the", "d" + "ev", "mach" + "ine"),
        ("before the GPU", "bud" + "get", "ran out, in", "/".join(("", "work", "main", "build"))),
    )
    sample = " ".join(word for line in pieces for word in line) + "."
    found = " ".join(_process_words(sample, hashes=True))
    for why in (
        "numbered development round",
        "commit hash",
        "development session",
        "build environment",
        "GPU budget",
        "absolute path",
    ):
        assert why in found, f"the scan missed {why}"
    assert not _process_words("at pytest session start; a session-scoped fixture", True)


def test_no_development_process_words() -> None:
    assert len(_scanned()) > 50, "the scan found too few files: has the layout moved?"
    bad = {
        str(path.relative_to(ROOT)): hits
        for path, text, hashes in _scanned()
        if (hits := _process_words(text, hashes))
    }
    assert not bad, "say what the product does, not how it was built: " + json.dumps(bad, indent=1)


# ----------------------------------------------------------------------- the docs as a site


def _require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail(
            "mkdocs is not installed: pip install -e '.[test]' (it holds mkdocs, "
            "mkdocs-material and mkdocstrings[python])"
        )


def _mkdocs(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    _require_mkdocs()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """Every page, every internal link and anchor, and the API reference resolve."""
    done = _mkdocs("build", "--strict", "-d", str(tmp_path / "site"), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "routes" / "index.html").read_text()
    assert "RouteRegistry" in reference and "register" in reference, (
        "the API reference did not render the registry's docstrings"
    )


def test_the_site_build_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    """The project's link validation settings turn a missing anchor into a failed build."""
    _require_mkdocs()
    import yaml  # mkdocs' own dependency

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](other.md#no-such-heading)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading\n")
    small = {
        "site_name": "check",
        "docs_dir": "docs",
        "strict": True,
        "validation": config["validation"],
        "markdown_extensions": ["toc"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    done = _mkdocs("build", "-d", str(tmp_path / "site"), cwd=tmp_path)
    assert done.returncode != 0 and "no-such-heading" in done.stderr, done.stderr[-2000:]


def test_the_cli_reference_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_dflash.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    commands = re.search(r"\{([\w,-]+)\}", capsys.readouterr().out)
    assert commands, "pytest-dflash --help lists no commands"
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    missing = [c for c in commands.group(1).split(",") if f"`pytest-dflash {c}" not in page]
    assert not missing, f"docs/reference/cli.md does not list: {missing}"


def test_render_shows_a_nested_record_leaf_by_leaf() -> None:
    """A script may write its figures as a record; every leaf becomes a row with its path."""
    render = _render_module()
    data = json.loads((ROOT / "benchmarks" / "results" / "cpu-main-job.json").read_text())
    data["values"] = {
        "routes": {"a": {"kl": 1.015019937861166e-12, "equal": True}},
        "bands": [{"delta": 0.0}, {"delta": 0.25}],
        "lengths": [512, 1024],
    }
    page = render.render([data])
    for row in (
        "| routes.a.kl | 1.01502e-12 |",
        "| routes.a.equal | true |",
        "| bands[1].delta | 0.25 |",
        "| lengths | 512, 1024 |",
    ):
        assert row in page, row
