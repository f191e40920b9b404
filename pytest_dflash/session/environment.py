"""Where the gates run: device, profile, dtype and evidence fingerprint of the session.

The one public place suites and engines ask "which device, which profile?" (never
``pytest_dflash.plugin``). What the user asked for comes from :mod:`pytest_dflash.settings`;
what it means on this machine is worked out here once per session and cached on the config;
torch is imported only when the device is first asked for.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_dflash import settings
from pytest_dflash.policy.profiles import ProfileSizes, sizes

if TYPE_CHECKING:
    import torch

_DEVICE = pytest.StashKey[dict[str, Any]]()
_PROFILE = pytest.StashKey[str]()


def device_info(config: pytest.Config) -> dict[str, Any]:
    """Device of the gates: type (cpu/cuda), name, capability, torch and CUDA versions.

    ``auto`` takes CUDA when torch sees a device. Asking for ``cuda`` without one is a usage
    error naming the alternatives, never a silent CPU run.
    """
    if _DEVICE not in config.stash:
        import torch

        wanted = settings.of(config).device
        has_cuda = torch.cuda.is_available()
        if wanted == "cuda" and not has_cuda:
            raise pytest.UsageError("--dflash-device cuda, but torch sees no CUDA device; "
                                    "use --dflash-device cpu or auto")
        kind = "cuda" if wanted == "cuda" or (wanted == "auto" and has_cuda) else "cpu"
        info: dict[str, Any] = {"type": kind, "torch": torch.__version__,
                                "cuda": torch.version.cuda, "capability": None}
        cards = settings.of(config).gpu_plan  # controller of a run with a GPU per worker
        if kind == "cuda" and cards and cards[0].capability:
            # named from the plan (nvidia-smi): the controller never opens a CUDA context
            info.update(name=cards[0].name, capability=cards[0].capability)
        elif kind == "cuda":
            major, minor = torch.cuda.get_device_capability()
            info.update(name=torch.cuda.get_device_name(), capability=f"{major}.{minor}")
        else:
            info["name"] = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
        config.stash[_DEVICE] = info
    return config.stash[_DEVICE]


def torch_device(config: pytest.Config) -> torch.device:
    """The session's gate device as a ``torch.device``."""
    import torch

    return torch.device(device_info(config)["type"])


def profile_of(config: pytest.Config) -> str:
    """The session profile: the option, else the ini key, else ``full`` on CUDA, ``ci`` on CPU."""
    if _PROFILE not in config.stash:
        profile = settings.of(config).profile
        if not profile:
            profile = "full" if device_info(config)["type"] == "cuda" else "ci"
        config.stash[_PROFILE] = profile
    return config.stash[_PROFILE]


def resolved_profile(config: pytest.Config) -> str | None:
    """The profile if it was already resolved this session, else None (no torch import)."""
    return config.stash.get(_PROFILE, None)


def profile_sizes(config: pytest.Config) -> ProfileSizes:
    """The sizes of the session profile (``pytest_dflash.policy.profiles``)."""
    return sizes(profile_of(config))


def sidecar_path(config: pytest.Config) -> Path | None:
    """The explicit D256 library: ``--dflash-sidecar`` or the environment variable."""
    return settings.of(config).sidecar


def fingerprint_of(config: pytest.Config) -> dict[str, Any]:
    """The evidence fingerprint of this session (sources, libraries, device; docs/report.md)."""
    from pytest_dflash.evidence import fingerprint
    data = fingerprint.collect(config.rootpath, settings.of(config).sidecar)
    info = device_info(config)
    data.update(torch=info["torch"], cuda=info["cuda"], device=info["name"],
                engine=engine_identity(settings.of(config)))
    data["libraries"] = _loaded_libraries()
    return data


def engine_identity(asked: settings.Settings) -> str:
    """What computed the model-level evidence, as far as a merge must match it: the reference
    engine, the transformers engine with its model directory's name and compute dtype (a
    bfloat16 run and a float32 run of one model are different evidence), or servers."""
    if asked.serve or asked.engine_urls:
        return "server"
    if asked.hf_model is not None:
        return f"transformers {asked.hf_model.name} {asked.hf_dtype or 'float32'}"
    return "reference"


def _loaded_libraries() -> list[dict[str, Any]]:
    loader = sys.modules.get("pytest_dflash.native.loader")
    if loader is None or not hasattr(loader, "loaded_libraries"):
        return []
    return list(loader.loaded_libraries())


def header_lines(config: pytest.Config) -> list[str]:
    """The ``dflash:`` line of the pytest header: device, versions, profile, fingerprint."""
    from pytest_dflash.evidence import fingerprint
    info = device_info(config)
    capability = info["capability"] or "n/a"
    fp = fingerprint_of(config)
    return [f"dflash: device {info['name']} (capability {capability}), torch {info['torch']}, "
            f"CUDA {info['cuda'] or 'none'}, profile {profile_of(config)}, "
            f"fingerprint {fingerprint.short(fp)}"]
