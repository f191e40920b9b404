"""Every size that depends on the profile, declared once (docs/profiles.md).

A profile scales the work of every gate: ``full`` measures at the target deployment's sizes on the
GPU, ``ci`` runs the whole matrix on a 2-core CPU, ``quick`` is a smoke run. Gates read these
numbers in exactly two ways, both through this table:

- ``dflash_gate.sizes.<field>`` inside a test (a loop over lengths, a scale divisor, a count);
- ``@pytest.mark.gate(kind, family=..., per_size="<field>")``: the plugin parametrizes the test's
  ``size`` argument over the field's values, so a size of another profile is not a skipped test
  (a skip would leave the gate pending), it is simply not part of the run.

Changing a number here changes what every gate of that profile measures; every report names the
profile it ran with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.vocabulary import check_profile


@dataclass(frozen=True)
class ProfileSizes:
    """The sizes of one profile. Field comments say which gate reads them."""

    # model-level gates (reference engine, pytest_dflash.engines.data)
    ppl_segments: int  # ppl: held-out segments scored
    ppl_bytes: int  # ppl: bytes of each segment scored (BOS-prefixed)
    ppl_long_contexts: int  # ppl: held-out long contexts scored by position band
    ppl_long_tokens: int  # ppl: least tokens of each (more where 3 seams of a chunk need more)
    quality_tasks: int  # quality: held-out coding tasks generated per route
    prefill_lengths: tuple[int, ...]  # prefill (every engine family): prompt lengths, 32K:64K ratio
    verify_prompt: int  # validation_cost (engine): prompt prefilled before the verify steps
    geometry_divisor: int  # prefill.geometry: chunk sizes Q are the deployment's divided by this
    # op-level gates of gemm.nvfp4
    gemm_divisor: int  # target layer shapes and prefill M divided by this (K kept % 64)
    benchmark_rounds: int  # speed (gemm): rounds of the pytest-benchmark twin test
    # op-level gates of attn.d256
    attn_long_t: tuple[int, ...]  # parity: causal prefill lengths (error must not grow with T)
    attn_paged: tuple[int, int]  # parity: (Tq, kv_len) of the paged cases
    attn_speed_t: tuple[int, ...]  # speed: causal prefill lengths timed
    # every timing gate: the most looks of ``policy.timing_processes`` worker processes (None:
    # as many as ``policy.timing_max_processes`` allows). A size, not a threshold: fewer
    # processes widen an interval, so a gate that cannot decide in them ends pending, never
    # passes on less evidence (docs/profiles.md)
    timing_looks: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SIZES: dict[str, ProfileSizes] = {
    "quick": ProfileSizes(
        ppl_segments=2, ppl_bytes=128, ppl_long_contexts=1, ppl_long_tokens=2048,
        quality_tasks=4, prefill_lengths=(256, 512),
        verify_prompt=64, geometry_divisor=16, gemm_divisor=32, benchmark_rounds=3,
        attn_long_t=(512,), attn_paged=(97, 203), attn_speed_t=(512,),
        # a smoke run: its tiny shapes cannot resolve a 1% margin on a GPU, and further looks
        # there only added processes to gates that ended pending anyway (more than half of the
        # self-test's validation_cost seconds, benchmarks/results/h100-selftest-quick.json)
        timing_looks=1),
    "ci": ProfileSizes(
        ppl_segments=8, ppl_bytes=512, ppl_long_contexts=1, ppl_long_tokens=4096,
        # one prefill length: the prefill gate serves all three families here, and four cold
        # prefill pairs are what the 2-core main job affords (benchmarks: cpu-main-job-cost)
        quality_tasks=20, prefill_lengths=(1024,),
        verify_prompt=512, geometry_divisor=8, gemm_divisor=8, benchmark_rounds=10,
        attn_long_t=(1024, 4096), attn_paged=(301, 1001),
        # one op-level length: fa2's claim is carried by the model-level prefill gate too, and
        # T=4096 took 43-49 s of the main job (18 processes) against 9-21 s at 2048
        attn_speed_t=(2048,),
        # one look of the policy's 6 processes at the nominal confidence: on two cores every
        # timing gate but one decides at the first look, where the interim look's share of the
        # error rate gave it an interval twice as wide; the later looks only timed fa2's
        # 1024-token cold prefill, whose gain sits on the 1% margin, up to 18 processes and
        # mostly ended pending anyway. Replayed on 26 recorded runs, 234 processes against 294,
        # every other result keeps its verdict but the identical-cost verify widths, which pass
        # in 98 to 100% of resampled runs and are pending otherwise
        # (benchmarks/results/cpu-one-look-replay.json); the A/A passed 10 of 10 runs
        # (cpu-timing-aa-validation-cost.json)
        timing_looks=1),
    "full": ProfileSizes(
        ppl_segments=16, ppl_bytes=1024, ppl_long_contexts=2, ppl_long_tokens=32768,
        quality_tasks=300, prefill_lengths=(32768, 65536),
        verify_prompt=4096, geometry_divisor=1, gemm_divisor=1, benchmark_rounds=30,
        attn_long_t=(2048, 8192, 32768, 65536), attn_paged=(1031, 4099),
        attn_speed_t=(32768, 65536)),
}


def sizes(profile: str) -> ProfileSizes:
    """The sizes of ``profile``; an unknown name raises UnknownNameError listing the profiles."""
    return SIZES[check_profile(profile)]


def with_profile_timing(policy: Policy, profile: str) -> Policy:
    """``policy`` with the timing size of ``profile`` (``ProfileSizes.timing_looks``): the
    process cap lowered to that many looks, never raised above the policy's."""
    looks = sizes(profile).timing_looks
    if looks is None:
        return policy
    cap = min(policy.timing_max_processes, looks * policy.timing_processes)
    return dataclasses.replace(policy, timing_max_processes=cap)


def per_size_values(spec: str | dict[str, Any], profile: str) -> tuple[Any, ...]:
    """Values a ``per_size=`` gate marker parametrizes ``size`` over in ``profile``.

    ``spec`` names a field of :class:`ProfileSizes` (the shipped suites) or is a table
    ``{profile: values}`` of a suite of your own; either way every profile must be covered.
    """
    if isinstance(spec, str):
        if spec not in ProfileSizes.__dataclass_fields__:
            raise ValueError(f"per_size={spec!r} names no profile size; known: "
                             f"{', '.join(ProfileSizes.__dataclass_fields__)}")
        values = getattr(sizes(profile), spec)
    elif isinstance(spec, dict):
        if profile not in spec:
            raise ValueError(f"per_size table {spec!r} has no entry for profile {profile!r}")
        values = spec[profile]
    else:
        raise ValueError(f"per_size must name a profile size or be a {{profile: values}} table, "
                         f"got {type(spec).__name__}")
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)
