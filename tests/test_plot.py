"""`pytest-dflash plot`: real PNG and SVG files, decoded and checked for what they show, drawn
from the report of real gates (``real_runs``: a speed gate timed in worker processes, parity)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from reportmaker import fingerprint

from pytest_dflash.evidence import report as reports
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import Route

pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is part of the test extra")

RED, GREEN, ORANGE = (0xC6, 0x28, 0x28), (0xA5, 0xD6, 0xA7), (0xE6, 0x51, 0x00)
DIAMOND, STRIP = (0x15, 0x65, 0xC0), (0x64, 0xB5, 0xF6)

ROUTE = Route("toy.mm.fast", "toy.mm", "candidate", baseline="toy.mm.base",
              gates=("quality",))


def _quality_report(path: Path) -> Path:
    """A quality gate's per-task record (the model-level quality gate is too slow to run here
    for every session; its record's shape is the one ``metrics.quality`` writes)."""
    data = reports.new_report(routes=[ROUTE], fingerprint=fingerprint(),
                              device={"name": "cpu", "type": "cpu"}, profile="quick",
                              policy=Policy().as_dict())
    per_task = [{"task_id": f"t{i}",
                 "baseline": {"passed": i % 4 != 0, "contract_ok": True, "natural_stop": True},
                 "candidate": {"passed": i % 4 != 0 or i == 8, "contract_ok": i != 5,
                               "natural_stop": True}} for i in range(60)]
    reports.add_test(data, ROUTE.name, "quality", {
        "nodeid": "suites/t.py::test_quality[toy.mm.fast]", "outcome": "passed",
        "duration_s": 1.0, "message": "", "measurements": {
            "per_task": per_task, "pass_at_1_baseline": 0.75, "pass_at_1_candidate": 0.77,
            "mcnemar_p_regression": 1.0}})
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


def _band_rows(pixels: np.ndarray) -> int:
    """Rows the interval band crosses: a horizontal span (#ffb300 at alpha 0.35) tints most of
    the axes' width amber, fully or, on the band's anti-aliased edge rows, faintly. Counted by
    row, not by pixel share: a narrow interval (a quiet run) covers a row or two of the y range,
    none of them perhaps at full tint, and the legend's swatch alone is one short run of
    pixels."""
    r, g, b = (pixels[..., k] for k in range(3))
    tinted = (r >= 250) & (b <= 245) & (g - b >= 10)
    return int((tinted.mean(axis=1) > 0.4).sum())


def _plot(report: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", "plot", str(report), "-o",
                           str(out)], capture_output=True, text=True, timeout=300)


SPEED = "attn.d256.fa2__speed__test_attn_speed_cold_prefill_attn.d256.fa2-T512"


@pytest.fixture(scope="module")
def plotted(real_runs, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real `pytest-dflash plot` run over the merged report of real gates (shared)."""
    out = tmp_path_factory.mktemp("plot") / "plots"
    done = _plot(real_runs.merged, out)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_plot_writes_one_png_and_svg_per_picture(plotted: tuple[Path, str]) -> None:
    out, stdout = plotted
    stems = sorted(p.stem for p in out.glob("*.png"))
    assert stems == sorted([SPEED, "attn.d256.fa2__parity"])
    assert sorted(p.stem for p in out.glob("*.svg")) == stems
    assert sorted(stdout.split()) == sorted(str(p) for p in out.iterdir())
    for svg in out.glob("*.svg"):
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg") and svg.stat().st_size > 5_000


def test_a_timing_picture_shows_each_process_its_rounds_and_the_interval(
        real_runs, plotted: tuple[Path, str]) -> None:
    out = plotted[0]
    speed = _pixels(out / f"{SPEED}.png")
    height, width, _ = speed.shape
    assert width >= 350 and height >= 250
    assert _share_near(speed, (255, 255, 255), 5) < 0.95  # not blank
    assert _share_near(speed, DIAMOND, 30) > 0.001  # the processes' ratios
    assert _share_near(speed, STRIP, 30) > 0.0005  # their rounds
    assert _share_near(speed, RED) > 0.0005  # the threshold line
    assert _share_near(speed, ORANGE) > 0.0005  # the ratio
    assert _band_rows(speed) >= 1  # the interval, across the axes
    # the SVG has one diamond per process the gate timed
    record = real_runs.load(real_runs.merged)["routes"]["attn.d256.fa2"]["gates"]["speed"][
        "tests"][0]["measurements"]
    svg = (out / f"{SPEED}.svg").read_text()
    assert f"interval [{record['ci_low']:.3f}, {record['ci_high']:.3f}]" in svg
    assert f"worker process ({len(record['processes'])}; looks at" in svg
    assert len(record["processes"]) >= 6


def test_parity_and_quality_pictures_show_cases_and_tasks(plotted: tuple[Path, str],
                                                          tmp_path: Path) -> None:
    out = plotted[0]
    parity = _pixels(out / "attn.d256.fa2__parity.png")
    assert _share_near(parity, RED) > 0.0005  # the bound
    assert _share_near(parity, (255, 255, 255), 5) < 0.97
    done = _plot(_quality_report(tmp_path / "q.json"), tmp_path / "plots")
    assert done.returncode == 0, done.stderr
    quality = _pixels(tmp_path / "plots" / "toy.mm.fast__quality__test_quality_toy.mm.fast.png")
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
    path = _quality_report(tmp_path / "r.json")
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = "
            "None; from pytest_dflash.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "plot", str(path), "-o",
                           str(tmp_path / "p")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'pytest-dflash[plot]'" in done.stderr


def test_a_model_level_prefill_gate_is_plotted_like_any_timing_gate(
        real_runs, tmp_path: Path) -> None:
    """The prefill kind (whole-model cold prefills) is timed by the same worker protocol as
    speed: its tests get timing pictures too (they were skipped when the kinds were listed by
    hand). The real speed gate's records are filed under ``prefill`` here."""
    report = json.loads(Path(real_runs.merged).read_text())
    gates = report["routes"]["attn.d256.fa2"]["gates"]
    gates["prefill"] = gates.pop("speed")
    path = tmp_path / "prefill-report.json"
    path.write_text(json.dumps(report))
    done = _plot(path, tmp_path / "plots")
    assert done.returncode == 0, done.stderr
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert SPEED.replace("__speed__", "__prefill__") + ".png" in names, sorted(names)
