"""One GPU per pytest-xdist worker: discovery, the assignment plan, and what a worker owns.

Timing gates must never share a device, so a multi-GPU box runs them in parallel only when
every xdist worker owns exactly one card. The controller discovers the cards *without
initialising CUDA* (``nvidia-smi``, which also honours nothing but the driver), plans one card per
worker, and hands each worker its card through the worker's own environment
(``CUDA_VISIBLE_DEVICES`` = the card's UUID), set by execnet in the fresh worker process before
pytest, torch or any conftest is imported there. A worker restarted after a crash is started
from the same spec and gets the same card back.

Nothing here imports torch or pytest: the pytest wiring lives in ``pytest_dflash.xdist.plugin``
and the plugin; ``docs/multi-gpu.md`` is the user documentation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Test-only: pretend the box has this many GPUs (named "fake GPU", UUIDs GPU-fake-N). Used by the
# plugin's own tests to exercise the assignment on a machine without GPUs; never set it on a box
# whose verdicts you want to keep (docs/multi-gpu.md).
FAKE_COUNT_ENV = "DFLASH_FAKE_GPU_COUNT"
# Set by the controller, inherited by every worker: the plan, a JSON list of cards.
PLAN_ENV = "DFLASH_GPU_PLAN"
# Set per worker through its execnet spec: which card of the plan this worker owns.
SLOT_ENV = "DFLASH_GPU_SLOT"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
# Set by the controller, inherited by every worker: folder where workers leave the group of each
# timing test (route and gate) for the controller's scheduler.
GROUPS_ENV = "DFLASH_GPU_GROUPS"
# Set per worker through its execnet spec (unless the caller set it): the worker's share of the
# host's cores for torch's CPU threads. Two workers with a thread per core each oversubscribe the
# host, and the host-bound parts of a gate (kernel launches, oracles, the sandbox) slow down and
# grow noisier, which costs timing gates rounds.
THREADS_ENV = "OMP_NUM_THREADS"
# Set per worker through its execnet spec, with THREADS_ENV: the cores this worker runs on
# (comma-separated CPU ids), a disjoint share of the controller's. A host-bound timing gate (an
# engine's verify rounds launch hundreds of small kernels) loses rounds to the other workers'
# threads migrating onto its core; pinning keeps each worker's threads on cores of its own.
CPUS_ENV = "DFLASH_WORKER_CPUS"
# Gate kinds by how long their tests usually take on a GPU, longest first (full profile, one
# H200: an engine verify-cost gate 70-165 s, a cold-prefill (prefill) gate 50-110 s, quality 56 s,
# the loader fixture 16 s, ppl 6 s, a parity test a few seconds). Workers hand their tests to the
# scheduler in this order, so the longest gates start first and no worker is left running one
# at the end while the others idle (longest-processing-time-first).
LONGEST_FIRST: tuple[str, ...] = ("validation_cost", "prefill", "speed", "quality", "loader",
                                  "ppl", "parity")
QUERY = "index,name,uuid,compute_cap"
SMI_TIMEOUT_S = 30.0


class GpuError(RuntimeError):
    """The GPUs cannot be assigned as asked; the message names the problem and the fix."""


@dataclass(frozen=True)
class Gpu:
    """One card as the driver lists it: index (nvidia-smi / PCI bus order), model, UUID."""

    index: int
    name: str
    uuid: str
    capability: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Gpu:
        return cls(index=int(data["index"]), name=str(data["name"]), uuid=str(data["uuid"]),
                   capability=data.get("capability"))


# ---------------------------------------------------------------- discovery


def discover(environ: Mapping[str, str] | None = None) -> list[Gpu]:
    """The cards this process may use: the driver's list filtered by ``CUDA_VISIBLE_DEVICES``.

    An empty list means "no GPU here" (no ``nvidia-smi``, or it finds no device). A driver that
    is present but broken raises ``GpuError``: guessing would hide the problem.
    """
    env = os.environ if environ is None else environ
    fake = env.get(FAKE_COUNT_ENV)
    gpus = _fake(fake) if fake is not None else _nvidia_smi()
    return filter_visible(gpus, env.get(VISIBLE_ENV), env.get("CUDA_DEVICE_ORDER"))


def _fake(value: str) -> list[Gpu]:
    try:
        count = int(value)
        if count < 0:
            raise ValueError
    except ValueError:
        raise GpuError(f"{FAKE_COUNT_ENV}={value!r}: must be a whole number >= 0 "
                       "(it is a test-only override; unset it on a real box)") from None
    return [Gpu(i, "fake GPU", f"GPU-fake-{i}", None) for i in range(count)]


def _nvidia_smi() -> list[Gpu]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    done = _smi(exe, QUERY)
    if done.returncode != 0 and "compute_cap" in (done.stdout + done.stderr):
        done = _smi(exe, "index,name,uuid")  # drivers before 510 cannot report compute_cap
    text = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        if "No devices were found" in text:
            return []
        raise GpuError(f"nvidia-smi failed (exit {done.returncode}): {text[:300]}; fix the "
                       "driver, or run the gates on the CPU with --dflash-device cpu")
    return parse_smi(done.stdout)


def _smi(exe: str, fields: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise GpuError(f"nvidia-smi did not answer within {SMI_TIMEOUT_S:.0f} s; the driver is "
                       "hung: fix it or run with --dflash-device cpu") from None


def parse_smi(text: str) -> list[Gpu]:
    """Parse ``nvidia-smi --query-gpu=index,name,uuid[,compute_cap] --format=csv,noheader``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) not in (3, 4) or not fields[0].isdigit() or not fields[2].startswith(
                ("GPU-", "MIG-")):
            raise GpuError(f"cannot read nvidia-smi line {line!r}; expected 'index, name, uuid"
                           "[, compute_cap]'")
        capability = fields[3] if len(fields) == 4 and fields[3][:1].isdigit() else None
        gpus.append(Gpu(int(fields[0]), fields[1], fields[2], capability))
    return gpus


def filter_visible(gpus: Sequence[Gpu], visible: str | None,
                   order: str | None = None) -> list[Gpu]:
    """Apply a user's ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, like CUDA) to the driver list."""
    if visible is None:
        return list(gpus)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    chosen: list[Gpu] = []
    for entry in entries:
        if entry.startswith("MIG-"):
            raise GpuError(f"{VISIBLE_ENV}={visible}: MIG instances are not assigned per worker; "
                           "list whole GPUs (indices or GPU- UUIDs)")
        if entry.lstrip("-").isdigit():
            if len({g.name for g in gpus}) > 1 and order != "PCI_BUS_ID":
                raise GpuError(
                    f"{VISIBLE_ENV}={visible} names GPUs by index on a box with several models: "
                    "CUDA then orders them fastest first, nvidia-smi by PCI bus, so the index is "
                    "ambiguous; use the GPU- UUIDs from `nvidia-smi -L` or set "
                    "CUDA_DEVICE_ORDER=PCI_BUS_ID")
            matches = [g for g in gpus if g.index == int(entry)]
        else:
            matches = [g for g in gpus if g.uuid.startswith(entry)]
        if len(matches) != 1:
            listed = ", ".join(f"{g.index}={g.uuid}" for g in gpus) or "none"
            what = "no" if not matches else "more than one"
            raise GpuError(f"{VISIBLE_ENV}={visible}: entry {entry!r} matches {what} GPU "
                           f"(the driver lists: {listed})")
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


# ---------------------------------------------------------------- the plan


def plan(gpus: Sequence[Gpu], workers: int) -> list[Gpu]:
    """The card of each worker, in worker order; refused unless every worker gets its own card
    and all of them are one model (a verdict is a verdict for one card model)."""
    if workers < 1:
        raise GpuError(f"{workers} workers: nothing to assign")
    if not gpus:
        raise GpuError(f"{workers} xdist workers need one GPU each, but nvidia-smi lists no GPU "
                       "(not installed, no device, or none left by CUDA_VISIBLE_DEVICES); run "
                       "the gates on the CPU (--dflash-device cpu) or on a GPU box")
    if workers > len(gpus):
        raise GpuError(
            f"{workers} xdist workers but only {len(gpus)} GPU(s) visible "
            f"({', '.join(f'{g.index}: {g.name}' for g in gpus)}): each worker owns one GPU, "
            f"so timing gates never share a card; use -n {len(gpus)} or -n auto")
    chosen = list(gpus[:workers])
    models = sorted({g.name for g in chosen})
    if len(models) > 1:
        raise GpuError(
            f"the GPUs for the {workers} workers are of different models ({', '.join(models)}): "
            "one report holds evidence for one card model; set CUDA_VISIBLE_DEVICES to the "
            "UUIDs of one model (nvidia-smi -L) and gate the other model in a run of its own")
    return chosen


def encode_plan(cards: Sequence[Gpu]) -> str:
    return json.dumps([g.as_json() for g in cards], separators=(",", ":"))


def decode_plan(text: str) -> list[Gpu]:
    try:
        return [Gpu.from_json(item) for item in json.loads(text)]
    except (ValueError, TypeError, KeyError) as exc:
        raise GpuError(f"{PLAN_ENV} is not a plan written by pytest-dflash ({exc}); unset it"
                       ) from None


def core_shares(workers: int, cpus: Sequence[int] | None = None) -> list[list[int]] | None:
    """Disjoint, contiguous, equal shares of ``cpus`` (default: the cores this process may
    use), one per worker; None when there are fewer cores than workers (nothing to pin)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if workers < 1 or len(cpus) < workers:
        return None
    share = len(cpus) // workers
    return [cpus[i * share:(i + 1) * share] for i in range(workers)]


def pin_worker(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """Inside a worker: run this process (and the threads it starts) on the cores its spec
    named, and return them; None when the controller named none."""
    env = os.environ if environ is None else environ
    text = env.get(CPUS_ENV)
    if not text:
        return None
    try:
        cpus = sorted({int(c) for c in text.split(",")})
    except ValueError:
        raise GpuError(f"{CPUS_ENV}={text!r} is not a list of CPU ids; unset it") from None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise GpuError(f"{CPUS_ENV}={text!r}: cannot run on those cores ({exc}); unset it or "
                       f"set {THREADS_ENV} to share the cores yourself") from None
    return cpus


def schedule_rank(kind: str | None) -> int:
    """Position of a gate kind in :data:`LONGEST_FIRST` (tests of no gate last)."""
    return LONGEST_FIRST.index(kind) if kind in LONGEST_FIRST else len(LONGEST_FIRST)


def worker_spec(spec: str, slot: int, gpu: Gpu, threads: int | None = None,
                cpus: Sequence[int] | None = None) -> str:
    """An execnet spec that starts the worker with only ``gpu`` visible (before any import),
    with ``threads`` torch CPU threads and on the cores ``cpus`` when given."""
    if not spec.startswith("popen") and "//popen" not in spec:
        raise GpuError(f"--tx {spec}: GPUs are assigned to local (popen) workers only; use -n N")
    if f"env:{VISIBLE_ENV}=" in spec or f"env:{SLOT_ENV}=" in spec:
        raise GpuError(f"--tx {spec} sets {VISIBLE_ENV} itself; let pytest-dflash assign the "
                       "GPUs or run without -n")
    spec = f"{spec}//env:{VISIBLE_ENV}={gpu.uuid}//env:{SLOT_ENV}={slot}"
    if threads is not None:
        spec = f"{spec}//env:{THREADS_ENV}={threads}"
    if cpus:
        spec = f"{spec}//env:{CPUS_ENV}={','.join(map(str, cpus))}"
    return spec


# ---------------------------------------------------------------- inside a worker


def worker_gpu(environ: Mapping[str, str] | None = None) -> Gpu | None:
    """The card this process owns, or None when it is not a GPU-assigned xdist worker.

    Raises if the assignment was tampered with: a worker whose ``CUDA_VISIBLE_DEVICES`` is not
    its card would time on a card it does not own.
    """
    env = os.environ if environ is None else environ
    slot, text = env.get(SLOT_ENV), env.get(PLAN_ENV)
    if slot is None or text is None:
        return None
    cards = decode_plan(text)
    try:
        gpu = cards[int(slot)]
    except (ValueError, IndexError):
        raise GpuError(f"{SLOT_ENV}={slot!r} is not a slot of the plan ({len(cards)} GPUs)"
                       ) from None
    if env.get(VISIBLE_ENV) != gpu.uuid:
        raise GpuError(f"this worker owns GPU {gpu.index} ({gpu.uuid}) but {VISIBLE_ENV} is "
                       f"{env.get(VISIBLE_ENV)!r}: something changed it after the assignment")
    return gpu


def visible_devices(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value of this worker's card, or None outside GPU workers.

    Served engines put it into their server command's environment (``server_env``) so a
    server started by a worker sees that worker's card and no other.
    """
    gpu = worker_gpu(environ)
    return None if gpu is None else gpu.uuid


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess (e.g. an engine server) started by this worker."""
    env = dict(os.environ if base is None else base)
    value = visible_devices()
    if value is not None:
        env[VISIBLE_ENV] = value
    return env


# ---------------------------------------------------------------- grouping and the report


def group_name(route: str, kind: str) -> str:
    """The scheduling group of a timing gate: all its tests (hence its pairs) run on one worker."""
    return f"dflash:{route}:{kind}"


def write_groups(folder: str, slot: int, groups: Mapping[str, str]) -> None:
    """A worker's node id -> group map, written atomically where the controller reads it."""
    from pytest_dflash.evidence.files import write_json

    write_json(dict(groups), Path(folder) / f"slot{slot}.json", indent=None)


def read_groups(folder: str) -> dict[str, str]:
    """Every worker's node id -> group map, merged (all workers collect the same tests)."""
    merged: dict[str, str] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                merged.update(json.load(handle))
    return merged


def mixed_models(tests: Sequence[Mapping[str, Any]]) -> list[str]:
    """Card models that measured the given tests of one timing gate (more than one = refused)."""
    return sorted({t["gpu"]["name"] for t in tests if isinstance(t.get("gpu"), Mapping)})


def refuse_mixed_models(routes: Mapping[str, Any], kinds: Iterable[str]) -> list[str]:
    """Take back the evidence of every timing gate measured on more than one card model.

    Its measured tests become skipped with the reason, so the gate is pending (never passed,
    never failed: the candidate is not at fault); returns one problem line per such gate.
    """
    problems = []
    for name, entry in routes.items():
        for kind in set(kinds) & set(entry["gates"]):
            tests = entry["gates"][kind]["tests"]
            models = mixed_models(tests)
            if len(models) > 1:
                message = (f"refused: the {kind} gate of {name} was measured on different card "
                           f"models ({', '.join(models)}); rerun it on cards of one model "
                           "(docs/multi-gpu.md)")
                for test in tests:
                    if isinstance(test.get("gpu"), Mapping):
                        test["outcome"], test["message"] = "skipped", message
                problems.append(message)
    return problems
