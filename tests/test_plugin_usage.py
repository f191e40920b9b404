"""Usage errors, markers, --help and the import-light entry module."""

from __future__ import annotations

import subprocess
import sys

import pytest

TOY = """
from pytest_dflash import Family, Route
def pytest_dflash_routes(registry):
    registry.declare(Family("toy.mul", None, baseline="toy.mul.base", gates=("parity",)))
    registry.register(Route("toy.mul.base", "toy.mul", "baseline"))
    registry.register(Route("toy.mul.fast", "toy.mul", "candidate", baseline="toy.mul.base",
                            gates=("parity",)))
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_a="def test_a():\n    assert True\n")
    return pytester


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--dflash-route", "toy.mul.nope"], "*unknown route 'toy.mul.nope'; known routes:*"
                                              "toy.mul.fast*"),
        (["--dflash-route", "toy.mul.base"], "*only candidate routes are gated*baseline*"),
        (["--dflash-gate", "toy.mul.fast:sped"], "*unknown gate kind 'sped'; known kinds: "
                                                 "loader, parity, speed*"),
        (["--dflash-gate", "toy.mul.fast"], "*must look like ROUTE:KIND*"),
        (["--dflash-gate", "toy.mul.fast:speed"], "*does not require a speed gate; its gates: "
                                                  "parity*"),
        (["--dflash-device", "cuda"], "*--dflash-device cuda, but torch sees no CUDA device*"),
        (["--dflash-sidecar", "/no/such/lib.so"], "*--dflash-sidecar /no/such/lib.so: no such "
                                                  "file*"),
    ],
)
def test_usage_errors_name_what_exists(project: pytest.Pytester, args: list[str],
                                       expected: str) -> None:
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([expected])


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('registry.register(Route("toy.mul.fast", "toy.mul", "candidate", '
         'baseline="toy.mul.base", gates=("parity",)))',
         "*route 'toy.mul.fast' is registered twice*"),
        ('registry.register(Route("toy.mul.x", "toy.mul", "candidate", baseline="toy.mul.gone", '
         'gates=("parity",)))', "*names baseline 'toy.mul.gone', which is not registered*"),
        ('registry.register(Route("toy.mul.y", "toy.mul", "candidate", baseline="toy.mul.base", '
         'gates=("sped",)))', "*unknown gate kind 'sped'*"),
        ('registry.register(Route("toy.mul.z", "toy.mul", "candidate", baseline="toy.mul.base", '
         'gates=("parity",), default_enabled=True))', "*must be default-off until accepted*"),
        ('registry.register(Route("toy.mul.w", "toy.mul", "candidate", baseline="toy.mul.base"))',
         "*candidate route 'toy.mul.w' declares no gates, so it could never be judged; name the "
         "gates it needs*"),
        # a kind no test of the family measures: refused before any test runs, not pending
        ('registry.register(Route("toy.mul.q", "toy.mul", "candidate", baseline="toy.mul.base", '
         'gates=("parity", "quality")))',
         "*route 'toy.mul.q' declares gate 'quality', which no test of family 'toy.mul' measures "
         "(the gate would stay pending forever); the family offers: parity.*"),
        ('registry.register(Route("gemm.nvfp4.mine", "gemm.nvfp4", "candidate", '
         'baseline="gemm.nvfp4.turbomind", gates=("parity", "loader")))',
         "*route 'gemm.nvfp4.mine' declares gate 'loader', which no test of family 'gemm.nvfp4' "
         "measures*the family offers: parity, speed, prefill, validation_cost, ppl, quality.*"),
        ('registry.register(Route("toy.div.base", "toy.div", "baseline")); '
         'registry.register(Route("toy.div.fast", "toy.div", "candidate", '
         'baseline="toy.div.base", gates=("parity",)))',
         "*route 'toy.div.fast' declares gates parity, but family 'toy.div' is not declared*"
         "registry.declare(Family('toy.div', contract, baseline=..., gates=('parity',)))*"),
    ],
)
def test_registration_errors(project: pytest.Pytester, extra: str, expected: str) -> None:
    project.makeconftest(TOY + "    " + extra + "\n")
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([expected])


def test_unknown_kind_in_marker_is_a_collection_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_b="""
        import pytest

        @pytest.mark.gate("perplexity", family="toy.mul")
        def test_b(dflash_route):
            pass
    """)
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the session
    result.stdout.fnmatch_lines(["*unknown gate kind 'perplexity'; known kinds: loader, parity*"])


def test_gate_test_without_route_fixture_is_a_collection_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_b="""
        import pytest

        @pytest.mark.gate("parity", family="toy.mul")
        def test_b():
            pass
    """)
    result = project.runpytest()
    result.stdout.fnmatch_lines(["*a gate test must take the `dflash_route` fixture*"])


def test_markers_are_registered_for_strict_markers(project: pytest.Pytester) -> None:
    result = project.runpytest("--markers")
    for name in ("sm70", "gate(kind", "requires_sm70", "loader", "parity", "speed",
                 "validation_cost", "ppl", "quality"):
        result.stdout.fnmatch_lines([f"@pytest.mark.{name}*"])
    project.makepyfile(test_c="""
        import pytest

        @pytest.mark.sm70
        @pytest.mark.ppl
        @pytest.mark.requires_sm70
        def test_c():
            pass
    """)
    project.runpytest("--strict-markers", "test_c.py").assert_outcomes(skipped=1)


def test_help_lists_the_dflash_group(project: pytest.Pytester) -> None:
    result = project.runpytest("--help")
    result.stdout.fnmatch_lines(["pytest-dflash: gate candidate kernel routes:",
                                 "*--dflash-device={auto,cpu,cuda}*",
                                 "*--dflash-profile={quick,ci,full}*",
                                 "*--dflash-route=NAME*", "*--dflash-gate=ROUTE:KIND*",
                                 "*--dflash-sidecar=PATH*", "*--dflash-report=PATH*",
                                 "*--dflash-merge*", "*--dflash-strict*",
                                 "  dflash_profile (string):*",
                                 "*dflash_strict (bool): default for --dflash-strict*"])


def test_entry_module_imports_nothing_heavy() -> None:
    code = ("import sys, pytest_dflash.plugin, pytest_dflash; "
            "heavy = [m for m in ('torch', 'datasets', 'evaluate', 'numpy') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"entry module imported {done.stdout.strip()}"


def test_help_does_not_import_torch(project: pytest.Pytester) -> None:
    project.makeconftest(TOY + """
import sys

def pytest_unconfigure(config):
    print("TORCH_LOADED=" + str("torch" in sys.modules))
""")
    result = project.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["TORCH_LOADED=False"])


def test_sidecar_option_reaches_the_loader_and_the_fingerprint(project: pytest.Pytester,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    import hashlib
    import json

    monkeypatch.delenv("DFLASH_D256_LIBRARY", raising=False)
    library = project.path / "libsidecar.so"
    library.write_bytes(b"\x7fELF not really a library")
    project.makepyfile(test_sidecar=f"""
        import os
        import pytest

        @pytest.mark.gate("parity", family="toy.mul")
        def test_env(dflash_route, dflash_sidecar):
            assert os.environ["DFLASH_D256_LIBRARY"] == {str(library)!r}
            assert str(dflash_sidecar) == {str(library)!r}
    """)
    result = project.runpytest("--dflash-sidecar", str(library), "--dflash-route", "toy.mul.fast",
                               "test_sidecar.py")
    result.assert_outcomes(passed=1)
    fingerprint = json.loads((project.path / "dflash-report.json").read_text())["fingerprint"]
    assert fingerprint["sidecar_sha256"] == hashlib.sha256(library.read_bytes()).hexdigest()


def test_a_gate_test_with_no_selected_route_binds_to_none(project: pytest.Pytester) -> None:
    """A gate test whose family has no selected candidate gets pytest's empty parameter set
    (one skipped item, its route parameter NOTSET); it is no route's outcome: no verdict row,
    no report entry under a made-up name."""
    project.makeconftest(TOY + """
    registry.declare(Family("toy.add", None, baseline="toy.add.base", gates=("parity",)))
    registry.register(Route("toy.add.base", "toy.add", "baseline"))
    registry.register(Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
                            gates=("parity",)))
""")
    project.makepyfile(test_gates="""
        import pytest

        @pytest.mark.gate("parity", family="toy.mul")
        def test_mul(dflash_route):
            assert dflash_route.family == "toy.mul"

        @pytest.mark.gate("parity", family="toy.add")
        def test_add(dflash_route):
            assert dflash_route.family == "toy.add"
    """)
    report, junit = project.path / "r.json", project.path / "j.xml"
    result = project.runpytest("test_gates.py", "--dflash-route", "toy.add.fast", "-rs",
                               "--dflash-report", str(report), "--junitxml", str(junit))
    result.assert_outcomes(passed=1, skipped=1)
    import json

    routes = json.loads(report.read_text())["routes"]
    assert set(routes) == {"toy.add.fast"}
    assert "token" not in result.stdout.str()
    assert "token" not in junit.read_text()
