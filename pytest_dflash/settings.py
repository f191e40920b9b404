"""The settings of a pytest-dflash session: every ``--dflash-*`` option and ini key, resolved once.

The options are declared here and read here only: :func:`of` resolves them (option, else ini
key, else the environment variable where one exists, else the default) into one frozen
:class:`Settings` at configure time and keeps it on the config. Every other module asks that
object, so a default is written down in exactly one place and a bad value is one usage error,
raised before any test runs. What needs torch (which device ``auto`` means, the profile that
follows from it) is worked out later by :mod:`pytest_dflash.session.environment` from these
values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pytest_dflash.evidence import compact
from pytest_dflash.native.loader import SIDECAR_ENV
from pytest_dflash.routes.vocabulary import DTYPES, PROFILES
from pytest_dflash.sandbox.executor import ALLOW_UNJAILED_ENV

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
DEFAULT_REPORT = "dflash-report.json"
_SETTINGS = pytest.StashKey["Settings"]()


@dataclass(frozen=True)
class Settings:
    """What the user asked this session for; nothing here imports torch or touches hardware."""

    device: str = "auto"  # one of DEVICES; environment.device_info says what "auto" found
    profile: str | None = None  # None: full on CUDA, ci on the CPU
    routes: tuple[str, ...] = ()
    gates: tuple[str, ...] = ()
    sidecar: Path | None = None
    report: Path = Path(DEFAULT_REPORT)
    # rounds of each timing process kept in the report (evidence.compact); None keeps all
    report_rounds: int | None = compact.DEFAULT_KEEP
    progress_log: str | None = None  # as given: relative to the rootdir
    merge: bool = False
    shard: str | None = None  # "K/N" as given (checked by session.state.start)
    shard_costs: str | None = None  # a report file or kept run whose durations balance shards
    strict: bool = False
    selftest: bool = False
    selftest_calibrate: bool = False  # only the timing gates' copy and 1/2/5/10% slowdowns
    # run a gate's remaining tests after one has failed it (session.settled skips them)
    every_test: bool = False
    allow_unjailed: bool = False
    save: str | None = None  # "" means: save under the next number, no name
    compare: str | None = None
    benchmark_skip: bool = False
    benchmark_only: bool = False
    engine: str = "reference"  # "reference" or "hf" (then hf_model is the model directory)
    hf_model: Path | None = None
    # the transformers engine's compute dtype on both sides of every comparison (None: float32,
    # the checkpoint's precision on the CPU); a route that sets its own dtype keeps it
    hf_dtype: str | None = None
    serve: str | None = None
    engine_urls: dict[str, str] = field(default_factory=dict)
    serve_timeout_s: float = 600.0
    data: Path | None = None
    # the controller's plan of a run with one GPU per xdist worker (``pytest_dflash.xdist``):
    # one card record per worker slot, None outside GPU-distributed runs
    gpu_plan: tuple[Any, ...] | None = None


def add_options(parser: pytest.Parser) -> None:
    """The ``--dflash-*`` options and their ini keys (docs: README "Options")."""
    group = parser.getgroup("dflash", "pytest-dflash: gate candidate kernel routes")
    group.addoption("--dflash-device", choices=DEVICES, default=None,
                    help="device the gates run on (default: ini dflash_device, else auto)")
    group.addoption("--dflash-profile", choices=PROFILES, default=None,
                    help="gate sizes: quick | ci | full (default: ci on CPU, full on CUDA)")
    group.addoption("--dflash-route", action="append", default=[], metavar="NAME",
                    help="gate only this candidate route (repeatable)")
    group.addoption("--dflash-gate", action="append", default=[], metavar="ROUTE:KIND",
                    help="run exactly this gate of this route, e.g. to rerun one failure "
                         "(repeatable)")
    group.addoption("--dflash-sidecar", default=None, metavar="PATH",
                    help="explicit D256 op library, loaded only if the bundled build lacks the "
                         f"ops (also ${SIDECAR_ENV})")
    group.addoption("--dflash-report", default=None, metavar="PATH",
                    help="JSON evidence report (default: ini dflash_report, else "
                         f"{DEFAULT_REPORT})")
    group.addoption("--dflash-report-rounds", default=None, metavar="N|all",
                    help="rounds of each timing process kept in the report, evenly spaced, "
                         "beside every process's summary of all its rounds (default: ini "
                         "dflash_report_rounds, else 32; 'all' keeps every round)")
    group.addoption("--dflash-progress-log", default=None, metavar="DIR",
                    help="also append the progress of long timing gates to DIR/<process>.log "
                         "(main, or the xdist worker id such as gw0), under -q and in workers "
                         "too; DIR is created if missing")
    group.addoption("--dflash-merge", action="store_true", default=None,
                    help="merge this run's results into the existing report (same evidence only)")
    group.addoption("--dflash-shard", default=None, metavar="K/N",
                    help="run only the K-th of N shares of the selected gates (one share per "
                         "host; every test of a timing gate in one share); join the shards' "
                         "reports with `pytest-dflash merge` (docs/multi-gpu.md)")
    group.addoption("--dflash-shard-costs", default=None, metavar="REF",
                    help="balance --dflash-shard by the test durations of this report file or "
                         "kept run (number or save name; default: the newest kept run, else "
                         "by count). Give every shard the same REF")
    group.addoption("--dflash-every-test", action="store_true", default=None,
                    help="run every test of a gate even after one has failed it (by default "
                         "they are skipped: they cannot change the verdict)")
    group.addoption("--dflash-strict", action="store_true", default=None,
                    help="fail the run if a selected candidate is left pending, or a gate's "
                         "self-test missed a planted defect (CI gate jobs)")
    group.addoption("--dflash-selftest", action="store_true", default=None,
                    help="plant the catalogue's defects next to every selected candidate and "
                         "prove each gate catches them here (docs/selftest.md)")
    group.addoption("--dflash-selftest-calibrate", action="store_true", default=False,
                    help="with --dflash-selftest: plant, next to every selected candidate, only "
                         "its timing gates' unchanged copy and 1%%, 2%%, 5%%, 10%% slowdowns (the "
                         "calibration that `pytest-dflash selftest --repeat K` repeats)")
    group.addoption("--dflash-allow-unjailed", action="store_true", default=False,
                    help="score generated code even where no file-system jail can be built "
                         "(the host's files readable to it); recorded in the report "
                         f"(docs/security.md; also ${ALLOW_UNJAILED_ENV}=1)")
    group.addoption("--dflash-save", nargs="?", const="", default=None, metavar="NAME",
                    help="keep this run's report under .dflash/ (optionally named NAME)")
    group.addoption("--dflash-compare", nargs="?", const="latest", default=None, metavar="REF",
                    help="compare this run with a kept run (sequence number, save name, "
                         "default the newest) or a report file, in the terminal summary")
    group.addoption("--dflash-engine", default=None, metavar="ENGINE",
                    help="the in-process engine of the model-level gates: 'reference' (the "
                         "default), 'hf:PATH' for a local Hugging Face causal LM, or 'hf' for "
                         "the tiny one shipped (extra [hf]; docs/engines.md)")
    group.addoption("--dflash-dtype", choices=DTYPES, default=None,
                    help="the transformers engine's compute dtype, baseline and candidate alike "
                         "(default float32): bfloat16 or float16 judge the routes as a GPU "
                         "stack runs them, e.g. SDPA backends that take no float32")
    group.addoption("--dflash-serve", default=None, metavar="CMD",
                    help="gate a server: the command that starts an OpenAI-compatible server "
                         "with {port} for its port, run once per route selection with that "
                         "selection's NAME=1 switches, e.g. 'vllm serve MODEL --port {port}'")
    group.addoption("--dflash-engine-url", action="append", default=[], metavar="KEY=URL",
                    help="gate servers you run: baseline=URL, candidate=URL or ROUTE=URL "
                         "(repeatable)")
    group.addoption("--dflash-serve-timeout", type=float, default=None, metavar="SECONDS",
                    help="how long a started server may take to become healthy (default 600)")
    group.addoption("--dflash-data", default=None, metavar="DIR",
                    help="held-out data of the ppl/quality gates: DIR/ppl_segments.jsonl and/or "
                         "DIR/coding_tasks.jsonl in the shipped schema")
    parser.addini("dflash_device", "default for --dflash-device", default="auto")
    parser.addini("dflash_profile", "default for --dflash-profile", default="")
    parser.addini("dflash_report", "default for --dflash-report", default=DEFAULT_REPORT)
    parser.addini("dflash_report_rounds", "default for --dflash-report-rounds", default="")
    parser.addini("dflash_strict", "default for --dflash-strict", type="bool", default=False)
    parser.addini("dflash_every_test", "default for --dflash-every-test", type="bool",
                  default=False)
    parser.addini("dflash_merge", "default for --dflash-merge", type="bool", default=False)
    parser.addini("dflash_selftest", "default for --dflash-selftest", type="bool", default=False)
    parser.addini("dflash_engine", "default for --dflash-engine", default="")
    parser.addini("dflash_dtype", "default for --dflash-dtype", default="")
    parser.addini("dflash_serve", "default for --dflash-serve", default="")
    parser.addini("dflash_engine_url", "default for --dflash-engine-url (one KEY=URL a line)",
                  type="linelist", default=[])
    parser.addini("dflash_serve_timeout", "default for --dflash-serve-timeout", default="600")
    parser.addini("dflash_data", "default for --dflash-data", default="")


def of(config: pytest.Config) -> Settings:
    """The session's settings, resolved on first use (configure time) and kept on the config."""
    if _SETTINGS not in config.stash:
        config.stash[_SETTINGS] = resolve(config)
    return config.stash[_SETTINGS]


def record_gpu_plan(config: pytest.Config, cards: list[Any]) -> None:
    """Add the xdist controller's GPU plan, worked out once its workers are known."""
    config.stash[_SETTINGS] = replace(of(config), gpu_plan=tuple(cards))


def xdist_controller(config: pytest.Config) -> bool:
    """Whether this process is the controller of an xdist run that starts workers (``-n`` or
    ``--tx`` with a ``--dist`` mode). Read live: xdist rewrites its options before configure."""
    option = config.option
    return (getattr(option, "dist", "no") != "no" and bool(getattr(option, "tx", None))
            and not hasattr(config, "workerinput"))


def xdist_dist(config: pytest.Config) -> str:
    """xdist's ``--dist`` mode (``no`` without xdist)."""
    return str(getattr(config.option, "dist", "no"))


def xdist_worker_specs(config: pytest.Config) -> list[Any]:
    """xdist's worker specs (``-n N`` / ``--tx``), as xdist parses them."""
    from xdist.workermanage import parse_tx_spec_config

    return list(parse_tx_spec_config(config))


def set_xdist_workers(config: pytest.Config, specs: list[str]) -> None:
    """Start xdist's workers from ``specs`` instead (one GPU each: ``xdist.gpus.worker_spec``)."""
    config.option.tx = list(specs)


def keep_xdist_order(config: pytest.Config) -> None:
    """Have xdist's group scheduler keep the workers' order of the test groups."""
    config.option.loadscopereorder = False


def active(config: pytest.Config) -> bool:
    """Whether the main plugin is active (``-p no:dflash`` leaves its options unregistered)."""
    try:
        config.getini("dflash_device")
    except ValueError:
        return False
    return True


def resolve(config: pytest.Config) -> Settings:
    """Options over ini keys over environment over defaults; every bad value a usage error."""

    def pick(name: str) -> Any:
        value = config.getoption(f"dflash_{name}", None)
        return config.getini(f"dflash_{name}") if value is None else value

    device = pick("device") or "auto"
    if device not in DEVICES:
        raise pytest.UsageError(f"dflash_device = {device!r}; use {', '.join(DEVICES)}")
    profile = pick("profile") or None
    if profile is not None and profile not in PROFILES:
        raise pytest.UsageError(f"dflash_profile = {profile!r}; use {', '.join(PROFILES)}")
    sidecar = _sidecar(config.getoption("dflash_sidecar", None))
    shard = config.getoption("dflash_shard", None)  # its form is checked at session start
    try:
        report_rounds = compact.parse_keep(pick("report_rounds"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    calibrate = bool(config.getoption("dflash_selftest_calibrate", False))
    return Settings(
        device=device, profile=profile,
        routes=tuple(config.getoption("dflash_route", None) or ()),
        gates=tuple(config.getoption("dflash_gate", None) or ()),
        sidecar=sidecar,
        report=_under(config.rootpath, pick("report") or DEFAULT_REPORT),
        report_rounds=report_rounds,
        progress_log=config.getoption("dflash_progress_log", None) or None,
        merge=bool(pick("merge")),
        shard=shard, shard_costs=config.getoption("dflash_shard_costs", None) or None,
        strict=bool(pick("strict")), selftest=bool(pick("selftest")),
        selftest_calibrate=calibrate,
        # the calibration measures what every size resolves: it runs every test
        every_test=bool(pick("every_test")) or calibrate,
        allow_unjailed=bool(config.getoption("dflash_allow_unjailed", False))
        or os.environ.get(ALLOW_UNJAILED_ENV) == "1",
        save=config.getoption("dflash_save", None),
        compare=config.getoption("dflash_compare", None),
        benchmark_skip=bool(config.getoption("benchmark_skip", False)),
        benchmark_only=bool(config.getoption("benchmark_only", False)),
        **_engine_options(config, pick),
    )


def export_to_children(settings: Settings) -> None:
    """Hand the settings that child processes need on through their environment.

    xdist workers, the sandbox and the loader's child interpreters read these variables; they
    are written once, here, when the session starts.
    """
    if settings.sidecar is not None:
        os.environ[SIDECAR_ENV] = str(settings.sidecar)
    if settings.allow_unjailed:
        os.environ[ALLOW_UNJAILED_ENV] = "1"


def _under(root: Path, value: str | Path) -> Path:
    path = Path(value)
    return path if path.is_absolute() else root / path


def _sidecar(option: str | None) -> Path | None:
    value = option or os.environ.get(SIDECAR_ENV)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    if option and not path.exists():
        raise pytest.UsageError(f"--dflash-sidecar {option}: no such file")
    return path


def _engine(config: pytest.Config, spec: str) -> tuple[str, Path | None]:
    """``--dflash-engine``: ("reference", None) or ("hf", model directory); a bad value is a
    usage error naming the fix (unknown engine, a missing directory, transformers missing)."""
    spec = spec.strip()
    if spec in ("", "reference"):
        return "reference", None
    kind, _, path = spec.partition(":")
    if kind != "hf":
        raise pytest.UsageError(f"--dflash-engine {spec!r}: unknown engine; give 'reference', "
                                "'hf' (the shipped tiny model) or 'hf:PATH' (a local Hugging "
                                "Face causal LM directory)")
    from pytest_dflash.engines import transformers as hf

    reason = hf.missing_library()
    if reason:
        raise pytest.UsageError(f"--dflash-engine {spec}: {reason}")
    model = _under(Path(config.invocation_params.dir), path) if path else hf.default_model_dir()
    try:
        return "hf", hf.check_model_dir(model)
    except hf.EngineError as exc:
        raise pytest.UsageError(str(exc)) from None


def _engine_options(config: pytest.Config, pick: Any) -> dict[str, Any]:
    """``--dflash-engine`` / ``--dflash-serve`` / ``--dflash-engine-url`` /
    ``--dflash-serve-timeout`` / ``--dflash-data``, checked now, before any test or server
    runs."""
    from pytest_dflash.engines.data import DataError, check_data_dir
    from pytest_dflash.engines.openai_server import parse_engine_urls

    serve = pick("serve") or None
    timeout = config.getoption("dflash_serve_timeout", None)
    if timeout is None:
        try:
            timeout = float(config.getini("dflash_serve_timeout"))
        except ValueError:
            raise pytest.UsageError("dflash_serve_timeout must be a number of seconds, got "
                                    f"{config.getini('dflash_serve_timeout')!r}") from None
    if timeout <= 0:
        raise pytest.UsageError(f"--dflash-serve-timeout {timeout:g}: must be > 0 seconds")
    try:
        urls = parse_engine_urls(list(pick("engine_url") or ()))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if serve and urls:
        raise pytest.UsageError("--dflash-serve starts servers, --dflash-engine-url names "
                                "running ones: give one of them")
    engine, hf_model = _engine(config, pick("engine") or "")
    if hf_model is not None and (serve or urls):
        raise pytest.UsageError("--dflash-engine hf runs the model in process; --dflash-serve "
                                "and --dflash-engine-url gate servers: give one of them")
    if serve and "{port}" not in serve:
        raise pytest.UsageError(f"--dflash-serve {serve!r} must contain {{port}} where the "
                                "server's port goes, e.g. 'vllm serve MODEL --port {port}'")
    if serve and (getattr(config.option, "numprocesses", None) or 0):
        raise pytest.UsageError("--dflash-serve starts one server at a time on the device; it "
                                "cannot run under pytest -n: run without -n")
    hf_dtype = pick("dtype") or None
    if hf_dtype is not None and hf_dtype not in DTYPES:
        raise pytest.UsageError(f"dflash_dtype = {hf_dtype!r}; use {', '.join(DTYPES)}")
    if hf_dtype is not None and hf_model is None:
        raise pytest.UsageError(
            f"--dflash-dtype {hf_dtype} sets the transformers engine's compute dtype; the "
            "reference engine computes in float32 and a server in its own: add --dflash-engine "
            "hf (or hf:PATH), or drop --dflash-dtype")
    data = pick("data") or None
    if data:
        try:
            data = check_data_dir(_under(Path(config.invocation_params.dir), data))
        except DataError as exc:
            raise pytest.UsageError(str(exc)) from None
    return {"engine": engine, "hf_model": hf_model, "hf_dtype": hf_dtype, "serve": serve,
            "engine_urls": urls,
            "serve_timeout_s": float(timeout), "data": data or None}
