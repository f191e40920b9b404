"""The predeclared gate policy: every threshold a gate may use, in one table.

Defaults live here; a project overrides them in ``[tool.pytest-dflash]`` of its pyproject. The
resolved table is printed in the report header and stored in the JSON report, and tests read
it through the ``dflash_policy`` fixture: no gate carries a private threshold.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PolicyError(ValueError):
    """An override in pyproject that names no threshold or has the wrong type."""


# The ppl gate's relative tolerance, 1e-3 (0.1% of perplexity): four times the largest
# rounding spread measured between routes that compute the same function (at most 1.4e-4: the
# fp16 SSM state against fp32 on one H200, per long-context band), rounded up on the 1-2-5
# series. The figures: benchmarks/results/ppl-rounding-spread.json, docs/gates.md ("ppl").
PPL_REL_TOLERANCE = 1e-3

# thresholds that were renamed because their unit changed: an old override must not be read
# in the new unit, so it is refused with the new name
RENAMED = {
    name: (f"it was an absolute perplexity difference, which means something else on every "
           f"model; it is now {new}, a relative change |PPL(candidate) / PPL(baseline) - 1| "
           f"(docs/gates.md, \"ppl\")", new)
    for name, new in (("ppl_tolerance", "ppl_rel_tolerance"),
                      ("ppl_byte_tolerance", "ppl_byte_rel_tolerance"),
                      ("ppl_band_tolerance", "ppl_band_rel_tolerance"))
}


@dataclass(frozen=True)
class Policy:
    # speed (docs/gates.md): pass only if the CI upper bound of candidate/baseline < 1 - min_gain
    speed_min_gain: float = 0.01
    speed_confidence: float = 0.95
    speed_rounds: int = 12
    speed_max_rounds: int = 48
    speed_warmup: int = 2
    # CPU samples last at least this long: a call shorter than it (measured once on the
    # baseline) is repeated back to back within each sample, the same number of times for both
    # sides, and the sample is their mean. A 300 us GEMV timed alone varies by >10% with OS
    # jitter on a 2-core host, enough for qpn2 timed against itself to fail the 1% no-regression
    # bar at 2 of 8 verify widths. Never on CUDA (one cold-L2 call per sample) and never with a
    # before_each reset (each call must see its reset).
    cpu_sample_min_s: float = 0.002
    # timing protocol (docs/gates.md): worker processes are the unit of repetition; the first
    # look takes timing_processes of them (the run's pool), each later look as many fresh ones,
    # up to timing_max_processes. Each worker times interleaved rounds for about
    # timing_process_s seconds (the round's cost measured in its warm-up), at least
    # timing_min_rounds_per_process and at most timing_max_rounds_per_process of them; later
    # looks take at least Kalibera & Jones' optimum from the measured variances. A budget in
    # seconds, not a round count: a 26 us graph replay and a 0.2 s cold prefill both get a
    # per-process statistic whose noise no longer swamps the 1% margin.
    timing_processes: int = 6
    timing_max_processes: int = 18
    timing_process_s: float = 0.25
    # on the CPU a no_regression gate's workers (validation_cost) time this long instead: its
    # candidate's true ratio sits at 1, one noise floor from the margin, and on two cores the
    # spread of identical code's per-process statistic is within-process noise that a longer
    # budget shrinks as 1/sqrt(seconds): with the median of the rounds, 0.93% at 0.25 s and 0.36
    # to 0.40% at 1 s (verify steps, benchmarks/results/cpu-round-design.json), where 8 widths
    # that must all pass at 0.25 s ended inconclusive in 2 to 4 of 10 runs of identical code.
    # The interquartile mean (process_statistics.process_statistic) reaches the median's spread
    # at 1 s in a little over half the rounds (cpu-process-statistic.json). Never on CUDA: a graph
    # replay already fills 0.25 s with a thousand rounds.
    cpu_validation_process_s: float = 0.6
    # a round that outlasts the budget (a cold prefill, a long attention) gets this many: a
    # process's statistic is the interquartile mean of its rounds, which for two is their mean,
    # so one call stretched by host dispatch or a preemption (0.15 s of a 0.35 s prefill on an
    # H200) sets it; for four it is the mean of the middle two, which discards that call.
    # Replayed on recorded runs, a process's spread fell by a third to three quarters and
    # near-margin gates passed in all resampled runs against 87.5 to 98% at two, for a CPU main
    # job about 14% longer (benchmarks/results/rounds-replay.json against spending-replay.json):
    # a verdict that reproduces comes before cost
    timing_min_rounds_per_process: int = 4
    timing_max_rounds_per_process: int = 4096
    # an interim look stops, inconclusive, when the predictive probability that the process cap
    # would decide (pass or fail) is below this: processes that cannot resolve the margin are
    # not timed (0: always run to the cap). It only ever ends a gate early as pending.
    timing_futility: float = 0.05
    # a worker that sends nothing (no answer, no progress line) this long is killed as hung
    timing_worker_timeout_s: float = 300.0
    bootstrap_resamples: int = 2000
    seed: int = 20261129
    # validation_cost: every M's CI upper bound <= 1 + noise floor
    validation_noise_floor: float = 0.01
    # ~1000 rounds are needed to bound a 1% regression under 5% noise (tests/test_statistics.py)
    validation_max_rounds: int = 1536
    validation_max_m: int = 8
    # parity: err(candidate) <= k * err(same-dtype torch reference) + floor, and relative L2
    parity_k: float = 2.0
    parity_floor: dict[str, float] = field(
        default_factory=lambda: {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
    )
    parity_rel_l2: dict[str, float] = field(
        default_factory=lambda: {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
    )
    # ppl: the largest per-segment relative change of perplexity, |PPL(candidate) /
    # PPL(baseline) - 1|, per token of the engine's tokenizer; a relative change means the same
    # on every model (to first order it is the change of mean log-loss in nats per token),
    # where an absolute delta of 0.01 was 0.006% of the tiny Llama's PPL 153 and 0.33% of the
    # reference model's 3.06. Set from the measured rounding spread (docs/gates.md, "ppl";
    # benchmarks/results/ppl-rounding-spread.json): PPL_REL_TOLERANCE below.
    ppl_rel_tolerance: float = PPL_REL_TOLERANCE
    # and per byte (exp(NLL / UTF-8 bytes)): comparable across tokenizers; for a byte-level
    # tokenizer the very same number as the per-token figure
    ppl_byte_rel_tolerance: float = PPL_REL_TOLERANCE
    # ppl, long contexts: the same relative change per position band (before the first chunk
    # seam, the ppl_band_tokens positions after each seam, the last ppl_band_tokens)
    ppl_band_rel_tolerance: float = PPL_REL_TOLERANCE
    ppl_band_tokens: int = 128
    # prefill gate, agreement after each cold prefill pair: the greedy next token
    # must equal the baseline's, and KL(candidate || baseline) of the next-token distributions
    # at the agreement_rows positions after every seam and on agreement_rows verify rows decoded
    # on the prefill must stay <= agreement_kl_bound. Measured at those positions (ci prompts,
    # CPU; benchmarks/results/cpu-seam-figures.json), KL(engine || fp64 reference) was at most
    # 1.08e-12 computing in fp32 and 3.27e-7 computing in fp16 as the SM70 deployment does. The
    # bound is 4x the fp16 figure, rounded up (two routes each within that rounding of the exact
    # result differ by up to twice it in logits, four times in KL): a route may move the
    # predictions no more than the deployment's own arithmetic does. It is over 1e6 times the
    # fp32 engine's spread, so a KL over it is never rounding noise of the reference.
    agreement_rows: int = 8
    agreement_kl_bound: float = 2e-6
    # quality: paired McNemar exact test on discordant tasks, plus output-contract margins
    quality_alpha: float = 0.05
    quality_contract_margin: int = 0
    quality_stop_rate_margin: float = 0.05
    quality_max_new_tokens: int = 256
    # completions an engine with generate_many decodes together (continuous batching), both
    # routes alike: on a GPU a decode step of a small model costs its kernel launches
    quality_batch: int = 32
    # sandboxed executor limits
    sandbox_timeout_s: float = 10.0
    sandbox_memory_mb: int = 512

    def __post_init__(self) -> None:
        if not self.cpu_sample_min_s >= 0:
            raise PolicyError(f"cpu_sample_min_s must be >= 0 seconds (0: one call per sample), "
                              f"got {self.cpu_sample_min_s}; fix [tool.pytest-dflash] "
                              f"cpu_sample_min_s")
        if not 2 <= self.timing_processes <= self.timing_max_processes:
            raise PolicyError(f"timing_processes must be >= 2 (an interval across processes "
                              f"needs two) and <= timing_max_processes, got "
                              f"{self.timing_processes} and {self.timing_max_processes}; fix "
                              f"[tool.pytest-dflash]")
        if not 2 <= self.timing_min_rounds_per_process <= self.timing_max_rounds_per_process:
            raise PolicyError(f"timing_min_rounds_per_process must be >= 2 (one round of each "
                              f"order) and <= timing_max_rounds_per_process, got "
                              f"{self.timing_min_rounds_per_process} and "
                              f"{self.timing_max_rounds_per_process}; fix [tool.pytest-dflash]")
        if not self.cpu_validation_process_s >= 0:
            raise PolicyError(f"cpu_validation_process_s must be >= 0 seconds (0: the minimum "
                              f"rounds), got {self.cpu_validation_process_s}; fix "
                              f"[tool.pytest-dflash]")
        if not self.timing_process_s >= 0:
            raise PolicyError(f"timing_process_s must be >= 0 seconds (0: the minimum rounds), "
                              f"got {self.timing_process_s}; fix [tool.pytest-dflash]")
        if not 0 <= self.timing_futility < 1:
            raise PolicyError(f"timing_futility must be a probability in [0, 1) (0: every "
                              f"inconclusive gate runs to timing_max_processes), got "
                              f"{self.timing_futility}; fix [tool.pytest-dflash]")
        if not self.timing_worker_timeout_s > 0:
            raise PolicyError(f"timing_worker_timeout_s must be > 0 seconds, got "
                              f"{self.timing_worker_timeout_s}; fix [tool.pytest-dflash]")
        if self.ppl_band_tokens < 1 or self.agreement_rows < 1:
            raise PolicyError(f"ppl_band_tokens and agreement_rows must be >= 1 position, got "
                              f"{self.ppl_band_tokens} and {self.agreement_rows}; fix "
                              f"[tool.pytest-dflash]")
        if self.quality_batch < 1:
            raise PolicyError(f"quality_batch must be >= 1 (completions decoded together), got "
                              f"{self.quality_batch}; set [tool.pytest-dflash] quality_batch = 1 "
                              f"or more")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rel_l2(self, dtype: str) -> float:
        return self.parity_rel_l2[_dtype_key(dtype)]

    def floor(self, dtype: str) -> float:
        return self.parity_floor[_dtype_key(dtype)]


def _dtype_key(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def policy_from_overrides(overrides: dict[str, Any]) -> Policy:
    known = {f.name: f for f in dataclasses.fields(Policy)}
    values: dict[str, Any] = {}
    for key, value in overrides.items():
        name = key.replace("-", "_")
        if name in RENAMED:
            why, new = RENAMED[name]
            raise PolicyError(f"[tool.pytest-dflash] {key}: {why}; set {new} instead")
        if name not in known:
            raise PolicyError(
                f"[tool.pytest-dflash] names unknown threshold {key!r}; known: {', '.join(known)}"
            )
        default = getattr(Policy(), name)
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise PolicyError(f"[tool.pytest-dflash] {key} must be a table, got {value!r}")
            value = {**default, **value}
        elif isinstance(default, bool) or not isinstance(value, (int, float)):
            raise PolicyError(f"[tool.pytest-dflash] {key} must be a number, got {value!r}")
        elif isinstance(default, int) and not isinstance(value, int):
            raise PolicyError(f"[tool.pytest-dflash] {key} must be an integer, got {value!r}")
        values[name] = value
    return Policy(**values)


def load_policy(rootdir: Path) -> Policy:
    """Read overrides from ``rootdir/pyproject.toml`` if it has a ``[tool.pytest-dflash]`` table."""
    pyproject = Path(rootdir) / "pyproject.toml"
    if not pyproject.is_file():
        return Policy()
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{pyproject}: not valid TOML ({exc}); fix the file") from None
    return policy_from_overrides(data.get("tool", {}).get("pytest-dflash", {}))
