"""Unit tests of the D256 loader beyond the loader gate's scenarios (suites/test_loader_d256.py).

Loading a native library cannot be undone inside a process, so every case that loads runs in
its own interpreter and reports the status as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_dflash.native import build
from pytest_dflash.native.loader import (
    SIDECAR_ENV,
    LoaderError,
    LoaderStatus,
    file_sha256,
    probe_library,
)


def run_child(code: str, **extra_env: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != SIDECAR_ENV} | extra_env
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_status_summary_names_state_file_and_missing_ops():
    st = LoaderStatus(state="partial", device="cpu", path="/x/lib.so", sha256="ab" * 32,
                      ops={"dense": {"present": True, "verified": True, "error": None},
                           "paged": {"present": False, "verified": False, "error": "gone"}},
                      error="boom")
    assert not st.ok and st.missing_ops() == ["paged"]
    assert st.summary() == ("dflash_d256 ops partial from /x/lib.so (sha256 abababababab) on "
                            "cpu; missing or failing: paged; boom")
    assert json.loads(json.dumps(st.as_json()))["ops"]["paged"]["error"] == "gone"
    assert LoaderStatus(state="sidecar", device="cpu").ok


def test_probe_refuses_a_text_file(tmp_path):
    text = tmp_path / "notes.so"
    text.write_text("not an ELF file\n")
    with pytest.raises(LoaderError, match=r"is not a loadable op library \(.*\)"):
        probe_library(text)


def test_probe_lists_the_ops_a_library_registers():
    """Probed from a fresh interpreter: the probe replays this process's loaded libraries first,
    and a test session that already loaded the full build would (rightly) see a clash."""
    library = build.build_library("dense_only")
    ops = run_child("import json\nfrom pathlib import Path\n"
                    "from pytest_dflash.native.loader import probe_library\n"
                    f"print(json.dumps(probe_library(Path({str(library)!r}))))")
    assert ops == ["dense", "dense_splitkv"]


def test_probe_after_the_full_build_reports_the_clash_instead_of_aborting():
    full, dense_only = build.build_library("full"), build.build_library("dense_only")
    status = run_child("import json, torch\nfrom pathlib import Path\n"
                       "from pytest_dflash.native.loader import LoaderError, probe_library\n"
                       f"torch.ops.load_library({str(full)!r})\n"
                       f"try:\n    probe_library(Path({str(dense_only)!r}))\n"
                       "    print(json.dumps('loaded'))\n"
                       "except LoaderError as exc:\n    print(json.dumps(str(exc)))")
    assert "killed by SIGABRT" in status and "refused" in status


def test_library_without_the_namespace_is_not_loaded():
    """A real shared library that registers no dflash_d256 ops (torch's own global-deps
    library) is refused after the probe: never loaded, state missing, clear error."""
    other = Path(torch.__file__).parent / "lib" / "libtorch_global_deps.so"
    report = run_child(
        "import json, warnings; warnings.simplefilter('ignore')\n"
        "from pytest_dflash.native import loader\n"
        f"st = loader.load_d256({str(other)!r}, bundled=None)\n"
        "print(json.dumps([st.state, st.error, loader.loaded_libraries()]))")
    state, error, loaded = report
    assert state == "missing" and loaded == []
    assert "registers no dflash_d256 ops" in error


def test_ops_without_a_kernel_for_the_device_are_not_verified():
    """A bundled library built with CPU kernels only (DFLASH_CUDA_ARCH=none): for CUDA the ops
    are present, not verified, the state is partial and the error gives the build's reason,
    whatever hardware runs the test (the dispatcher is asked before any call)."""
    report = run_child(
        "import json, warnings; warnings.simplefilter('ignore')\n"
        "from pytest_dflash.native import loader\n"
        "st = loader.load_d256(device='cuda')\n"
        "print(json.dumps([st.state, st.ops]))", DFLASH_CUDA_ARCH="none")
    state, ops = report
    assert state == "partial"
    for op in ("dense", "paged"):
        assert ops[op]["present"] and not ops[op]["verified"]
        assert "no kernel for dispatch key CUDA" in ops[op]["error"]
        assert ("the bundled build has no CUDA code (CUDA code not built: DFLASH_CUDA_ARCH=none)"
                in ops[op]["error"]), ops[op]["error"]


def test_current_status_follows_the_explicit_load():
    """Routes use the process's status: after an explicit load without the bundled library,
    the FA2 route refuses instead of quietly building and loading the bundled one."""
    report = run_child(
        "import json, warnings; warnings.simplefilter('ignore')\n"
        "from pytest_dflash.native import loader\n"
        "from dflash_kernels.attention import fa2_status\n"
        "st = loader.load_d256(bundled=None)\n"
        "print(json.dumps([st.state, fa2_status() is st, loader.loaded_libraries()]))")
    assert report == ["missing", True, []]


def test_ops_first_verified_inside_inference_mode_are_real():
    """An engine runs its routes inside ``torch.inference_mode``, so the loader's first check
    call can happen there. It used to fail there (an in-place update of an inference tensor),
    leaving the full build "partial" and the fa2 route unusable in every engine."""
    report = run_child(
        "import json, warnings, torch; warnings.simplefilter('ignore')\n"
        "from dflash_kernels.attention import FA2, fa2_status\n"
        "with torch.inference_mode():\n"
        "    q = torch.randn(5, 2, 256); kv = torch.randn(7, 1, 256); out = torch.empty_like(q)\n"
        "    FA2.dense(q, kv, kv, out, 0.0625, True)\n"
        "print(json.dumps([fa2_status().state, fa2_status().ok]))")
    assert report == ["bundled", True]


def test_loaded_libraries_carry_path_and_sha256():
    lib = build.build_library("full")
    report = run_child(
        "import json\n"
        "from pytest_dflash.native import loader\n"
        "st = loader.load_d256()\n"
        "print(json.dumps(loader.loaded_libraries()))")
    (entry,) = report
    assert entry == {"path": str(lib), "realpath": str(lib.resolve()),
                     "sha256": file_sha256(lib), "source": "bundled"}


def test_library_loaded_before_by_hand_is_adopted_not_reloaded():
    """Someone (an engine) already ran torch.ops.load_library on the bundled file: loading it
    again is a no-op, so the loader adopts it instead of refusing a clash with itself."""
    lib = build.build_library("full")
    report = run_child(
        "import json, torch\n"
        "from pytest_dflash.native import loader\n"
        f"torch.ops.load_library({str(lib)!r})\n"
        "st = loader.load_d256()\n"
        "print(json.dumps([st.state, st.error, st.sha256]))")
    assert report == ["bundled", None, file_sha256(lib)]
