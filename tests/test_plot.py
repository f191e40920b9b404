"""`pytest-dflash plot`: real PNG and SVG files, decoded and checked for what they show."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from reportmaker import fingerprint, timing

from pytest_dflash.evidence import report as reports
from pytest_dflash.routes.registry import Route
from pytest_dflash.session.policy import Policy

pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is part of the test extra")

RED, GREEN, ORANGE = (0xC6, 0x28, 0x28), (0xA5, 0xD6, 0xA7), (
    0xE6, 0x51, 0x00)

ROUTE = Route("toy.mm.fast", "toy.mm", "candidate", baseline="toy.mm.base",
              gates=("parity", "speed", "validation_cost", "quality"))


def _cases(n: int, failing: int) -> list[dict]:
    cases = []
    for i in range(n):
        ok = i != failing
        cases.append({"label": f"case {i}", "ok": ok, "max_abs": 1e-4 * (i + 1) * (30 if not ok
                                                                                 else 1),
                      "bound": 2e-3, "rel_l2": 1e-6 * (i + 1), "rel_l2_limit": 1e-5,
                      "nonfinite": 0})
    return cases


def _report(path: Path) -> Path:
    rng = np.random.default_rng(3)
    data = reports.new_report(routes=[ROUTE], fingerprint=fingerprint(),
                              device={"name": "cpu", "type": "cpu"}, profile="quick",
                              policy=Policy().as_dict())

    def add(kind: str, name: str, outcome: str, measurements: dict) -> None:
        reports.add_test(data, ROUTE.name, kind, {
            "nodeid": f"suites/t.py::{name}[toy.mm.fast]", "outcome": outcome,
            "duration_s": 1.0, "message": "", "measurements": measurements})

    add("speed", "test_speed", "passed", {**timing(list(0.9 + 0.02 * rng.standard_normal(24))),
                                          "shape": "M=64"})
    per_m = {f"m{m}": timing(list(1.0 + 0.004 * rng.standard_normal(200)), threshold=1.01,
                             rule="no_regression") for m in (1, 2, 3)}
    add("validation_cost", "test_vc", "failed", {"figure": "1/3 regressed", "per_m": per_m})
    add("parity", "test_parity_a", "passed", {"cases": _cases(6, failing=-1)})
    add("parity", "test_parity_b", "failed", {"cases": _cases(5, failing=2)})
    per_task = [{"task_id": f"t{i}",
                 "baseline": {"passed": i % 4 != 0, "contract_ok": True, "natural_stop": True},
                 "candidate": {"passed": i % 4 != 0 or i == 8, "contract_ok": i != 5,
                               "natural_stop": True}} for i in range(60)]
    add("quality", "test_quality", "passed", {"per_task": per_task, "pass_at_1_baseline": 0.75,
                                              "pass_at_1_candidate": 0.77,
                                              "mcnemar_p_regression": 1.0})
    reports.write_atomic(data, path)
    return path


def _pixels(path: Path) -> np.ndarray:
    from matplotlib import image

    rgba = image.imread(path)
    assert rgba.ndim == 3 and rgba.shape[2] in (3, 4), rgba.shape
    return (rgba[..., :3] * 255).round().astype(int)


def _share_near(pixels: np.ndarray, color: tuple[int, int, int], tol: int = 40) -> float:
    close = np.abs(pixels - np.array(color)).max(axis=2) <= tol
    return float(close.mean())


def _bluish(pixels: np.ndarray) -> float:
    """Share of pixels where blue clearly dominates (the scattered round ratios, any alpha)."""
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    return float(((b - r > 50) & (b - g > 25)).mean())


def _plot(report: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", "plot", str(report), "-o",
                           str(out)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plotted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real `pytest-dflash plot` run over the report above, shared by the checks below."""
    folder = tmp_path_factory.mktemp("plot")
    out = folder / "plots"
    done = _plot(_report(folder / "r.json"), out)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_plot_writes_one_png_and_svg_per_picture(plotted: tuple[Path, str]) -> None:
    out, stdout = plotted
    stems = sorted(p.stem for p in out.glob("*.png"))
    assert stems == sorted(["toy.mm.fast__speed__test_speed_toy.mm.fast",
                            "toy.mm.fast__validation_cost__test_vc_toy.mm.fast",
                            "toy.mm.fast__parity",
                            "toy.mm.fast__quality__test_quality_toy.mm.fast"])
    assert sorted(p.stem for p in out.glob("*.svg")) == stems
    assert sorted(stdout.split()) == sorted(str(p) for p in out.iterdir())
    for svg in out.glob("*.svg"):
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg") and svg.stat().st_size > 5_000


def test_timing_pictures_show_rounds_ci_and_threshold(plotted: tuple[Path, str]) -> None:
    out = plotted[0]
    speed = _pixels(out / "toy.mm.fast__speed__test_speed_toy.mm.fast.png")
    height, width, _ = speed.shape
    assert width >= 350 and height >= 250
    assert _share_near(speed, (255, 255, 255), 5) < 0.95  # not blank
    assert _bluish(speed) > 0.001  # the per-round ratios
    assert _share_near(speed, RED) > 0.0005  # the threshold line
    assert _share_near(speed, ORANGE) > 0.0005  # the median
    vc = _pixels(out / "toy.mm.fast__validation_cost__test_vc_toy.mm.fast.png")
    assert vc.shape[1] > 2 * width * 0.9  # three panels side by side
    assert _bluish(vc) > 0.002


def test_parity_and_quality_pictures_show_cases_and_tasks(plotted: tuple[Path, str]) -> None:
    out = plotted[0]
    parity = _pixels(out / "toy.mm.fast__parity.png")
    assert _share_near(parity, RED) > 0.0005  # the bound and the failed case's ring
    assert _share_near(parity, (255, 255, 255), 5) < 0.97
    quality = _pixels(out / "toy.mm.fast__quality__test_quality_toy.mm.fast.png")
    assert _share_near(quality, GREEN, 10) > 0.05  # passing cells dominate
    assert _share_near(quality, (0xEF, 0x9A, 0x9A), 10) > 0.01  # failing cells
    assert quality.shape[0] > 150  # 60 tasks wrap into two blocks of rows


def test_a_report_without_samples_plots_nothing_and_says_so(tmp_path: Path) -> None:
    data = reports.new_report(routes=[ROUTE], fingerprint=fingerprint(),
                              device={"name": "cpu", "type": "cpu"}, profile="ci",
                              policy=Policy().as_dict())
    path = tmp_path / "empty.json"
    reports.write_atomic(data, path)
    done = _plot(path, tmp_path / "plots")
    assert done.returncode == 0
    assert "no gate in this report recorded samples" in done.stderr


def test_missing_matplotlib_is_a_clear_error(tmp_path: Path) -> None:
    path = _report(tmp_path / "r.json")
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = "
            "None; from pytest_dflash.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "plot", str(path), "-o",
                           str(tmp_path / "p")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'pytest-dflash[plot]'" in done.stderr
