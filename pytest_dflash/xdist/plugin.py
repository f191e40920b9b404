"""pytest wiring of ``pytest_dflash.xdist.gpus``: ``pytest -n N`` on a GPU box gives each worker a
card.

Controller: when the run is distributed and the gates' device is not forced to the CPU, the
visible GPUs are discovered (no CUDA initialisation), one is planned per worker (more workers
than GPUs, or mixed card models, is a usage error) and every worker's execnet spec gets its card's
``CUDA_VISIBLE_DEVICES``. Each timing gate (route and kind) is one scheduling unit, so a gate's
baseline/candidate pairs are all timed in one worker, on one card: the workers leave the group
of each timing test in a folder and the controller's scheduler (xdist's ``loadgroup`` scheduler
with those groups) hands out whole groups. The groups do not travel as ``xdist_group`` marks:
with pytest 9.2 xdist's mark-to-node-id mechanism silently stops grouping (pytest-xdist issue
1386), and it would also rename the tests in the report. ``-n auto`` means one worker per
visible GPU. The workers hand their tests over longest gate kind first
(``gpus.LONGEST_FIRST``) and each runs on a share of the host's cores of its own (pinned,
one torch CPU thread per core).

Registered by the ``pytest11`` entry point ``dflash-gpus``; it acts only where the main plugin is
active. Without GPUs (or with ``--dflash-device cpu``) nothing changes: timing gates stay refused
under xdist.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS
from pytest_dflash.xdist import gpus

WORKER_GPU = pytest.StashKey["gpus.Gpu | None"]()
SAVED_ENV = pytest.StashKey["dict[str, str | None]"]()
RECORD = pytest.StashKey["dict[str, Any] | None"]()


def _wanted_gpus(config: pytest.Config) -> list[gpus.Gpu] | None:
    """The GPUs to spread over, or None when the gates run on the CPU (today's xdist mode)."""
    if not config.pluginmanager.has_plugin("dflash") or not settings.active(config):
        return None
    device = settings.of(config).device
    if device == "cpu":
        return None
    try:
        found = gpus.discover()
    except gpus.GpuError as exc:
        raise pytest.UsageError(f"pytest-dflash: {exc}") from None
    if not found and device == "auto":
        return None
    return found


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` on a GPU box: one worker per visible GPU (None: xdist counts CPUs)."""
    found = _wanted_gpus(config)
    return len(found) if found else None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.stash[WORKER_GPU] = None
    if hasattr(config, "workerinput"):
        _configure_worker(config)
    elif settings.xdist_controller(config):
        _configure_controller(config)


def _configure_controller(config: pytest.Config) -> None:
    found = _wanted_gpus(config)
    if found is None:
        return
    specs = settings.xdist_worker_specs(config)
    dist = settings.xdist_dist(config)
    if dist not in ("load", "loadgroup"):
        raise pytest.UsageError(
            f"pytest-dflash: --dist {dist} could split a timing gate across GPUs; with one GPU "
            "per worker pytest-dflash schedules whole timing gates itself: use the default "
            "--dist load (or loadgroup)")
    try:
        cards = gpus.plan(found, len(specs))
        # the caller's own thread setting, if any, reaches the workers by inheritance, and
        # then the caller shares the cores out too; otherwise each worker gets its own cores
        # and one torch thread per core (one thread, unpinned, with fewer cores than workers)
        shares, threads = None, None
        if gpus.THREADS_ENV not in os.environ:
            shares = gpus.core_shares(len(cards))
            threads = len(shares[0]) if shares else 1
        settings.set_xdist_workers(config, [
            gpus.worker_spec(specs[slot], slot, gpu, threads, shares[slot] if shares else None)
            for slot, gpu in enumerate(cards)])
    except gpus.GpuError as exc:
        raise pytest.UsageError(f"pytest-dflash: {exc}") from None
    config.stash[SAVED_ENV] = {name: os.environ.get(name)
                               for name in (gpus.PLAN_ENV, gpus.GROUPS_ENV)}
    # inherited by the workers
    os.environ[gpus.PLAN_ENV] = gpus.encode_plan(cards)
    os.environ[gpus.GROUPS_ENV] = tempfile.mkdtemp(prefix="dflash-gpu-groups-")
    settings.record_gpu_plan(config, cards)


def _configure_worker(config: pytest.Config) -> None:
    try:
        config.stash[WORKER_GPU] = gpus.worker_gpu()
        gpus.pin_worker()
    except gpus.GpuError as exc:
        raise pytest.UsageError(f"pytest-dflash: {exc}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    saved = config.stash.get(SAVED_ENV, None)
    if saved is None:
        return
    shutil.rmtree(os.environ[gpus.GROUPS_ENV], ignore_errors=True)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: hand the tests over longest gate kind first (every worker sorts alike, so the
    collections stay identical), and tell the controller's scheduler which tests form one
    timing gate."""
    if config.stash.get(WORKER_GPU, None) is None:
        return
    items.sort(key=lambda item: gpus.schedule_rank(_kind(item)))
    groups = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        route = callspec.params.get("dflash_route") if callspec else None
        kind = _kind(item)
        if route is not None and kind in EXCLUSIVE_KINDS:
            groups[item.nodeid] = gpus.group_name(route.name, kind)
    gpus.write_groups(os.environ[gpus.GROUPS_ENV], int(os.environ[gpus.SLOT_ENV]), groups)


def _kind(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("gate")
    return marker.args[0] if marker is not None and marker.args else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if plan_of(config) is None:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GateGroupScheduling(LoadGroupScheduling):
        """xdist's group scheduler, the groups read from the workers' maps, not node ids.

        xdist asks for scopes only once every worker has finished collecting, so the maps
        are complete when first read."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = gpus.read_groups(os.environ[gpus.GROUPS_ENV])
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    # keep the workers' longest-first order: xdist would otherwise sort the units by test count
    settings.keep_xdist_order(config)
    return GateGroupScheduling(config, log)


def plan_of(config: pytest.Config) -> list[gpus.Gpu] | None:
    """The controller's plan (one card per worker slot), or None outside GPU-distributed runs."""
    if not settings.active(config):
        return None
    plan = settings.of(config).gpu_plan
    return list(plan) if plan is not None else None


def gpu_of(config: pytest.Config) -> gpus.Gpu | None:
    """The card this worker owns, or None (controller, CPU run, or no GPU assignment)."""
    return config.stash.get(WORKER_GPU, None)


def pytest_report_header(config: pytest.Config) -> list[str]:
    cards = plan_of(config)
    if not cards:
        return []
    owned = "; ".join(f"worker {slot}: GPU {g.index} {g.name} {g.uuid}"
                      for slot, g in enumerate(cards))
    return [f"dflash: {len(cards)} xdist workers, one GPU each ({owned})"]


def timing_refusal(config: pytest.Config,
                   device_info: Callable[[pytest.Config], dict[str, Any]]) -> str | None:
    """Why a timing gate may not run in this process, or None when it may.

    A session without xdist owns its device. An xdist worker may time only on a GPU of its own:
    on the CPU, or without an assignment, the workers share the device. ``device_info`` is the
    session's (``pytest_dflash.session.environment.device_info``), asked only in a GPU worker.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    gpu = gpu_of(config)
    if gpu is None:
        return ("never share the device with parallel workers; rerun them without -n (or with "
                "-n0), or on GPUs, one per worker (docs/multi-gpu.md)")
    info = device_info(config)
    if info["type"] != "cuda":
        return (f"never share the device with parallel workers: this worker owns GPU "
                f"{gpu.index} but the gates run on {info['name']}; use --dflash-device cuda "
                "with a CUDA build of torch, or rerun them without -n")
    return None


def gpu_record(config: pytest.Config,
               device_info: Callable[[pytest.Config], dict[str, Any]]) -> dict[str, Any] | None:
    """The card that measures this process's tests (index, name, UUID), None on the CPU.

    In a GPU worker it is the worker's card; in a one-GPU session it is torch's current device,
    named as ``nvidia-smi`` names it where that is available (so both kinds of run agree).
    ``device_info`` is the session's (``pytest_dflash.session.environment.device_info``).
    """
    if device_info(config)["type"] != "cuda":
        return None
    if RECORD not in config.stash:
        gpu = gpu_of(config) or _torch_gpu()
        config.stash[RECORD] = {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid}
    return config.stash[RECORD]


def _torch_gpu() -> gpus.Gpu:
    import torch

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = f"GPU-{uuid}"
    try:
        listed = {g.uuid: g for g in gpus.discover({})}  # every card, in nvidia-smi order
    except gpus.GpuError:
        listed = {}
    card = listed.get(uuid)
    if card is not None:
        return card
    return gpus.Gpu(index, props.name, uuid or f"cuda:{index}", f"{props.major}.{props.minor}")
