"""Support for the linear.gdn gates: seeded gated-delta-rule inputs, contract calls that prove
the candidate was called (a route hit on itself), and the judgement of outputs and final states
against the fp64 oracle with the three-way rule, next to the measure flash-linear-attention's
own tests use.

fla's tests compare a kernel with a naive recurrent reference by the RMS of the difference over
the RMS of the reference (0.005 for the chunk kernel's output and final state, 0.002 for the
fused recurrent kernel's). Against the oracle that ratio is exactly our relative L2 error, so
each case records it as ``fla_ratio`` beside ``fla_anchor`` (fla's figure, an anchor to compare
with) and ``rel_l2_limit`` (our bound, the policy's, which decides).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dflash_suites.support import no_zeros
from pytest_dflash.measure.numerics import ParityResult, check_parity
from pytest_dflash.native import hits

if TYPE_CHECKING:
    from pytest_dflash.measure.gate import GateContext

# A Qwen3.5 gated-DeltaNet layer's head layout, scaled down in head count: 4 query/key heads,
# each serving 2 value heads, head dims 128. The dispatch point gets q/k already expanded to
# the value heads: transformers before 5.25 expands them in the layer and its torch fallback
# takes only equal head counts (later versions expand inside the fallback, a no-op then).
HK, HV, DK, DV = 4, 8, 128, 128
FLA_ANCHOR = {"chunk": 0.005, "recurrent": 0.002}
MAX_ORACLE_T = 8192  # the fp64 oracle steps token by token: longer cases cost minutes


def gate_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes the layers run in on this device: bf16 and fp16 on a GPU, fp32 on the CPU."""
    return (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)


def make_inputs(t: int, *, seed: int, dtype: torch.dtype, device: torch.device,
                state: bool = True) -> dict[str, Any]:
    """q/k/v ``[1, t, HV, D]`` (q/k drawn for HK heads, each repeated for its HV / HK value
    heads, as the layer hands them over), log decay g <= 0 and beta in (0, 1) ``[1, t, HV]`` as
    the layer computes them (``-exp(A) * softplus(a)``, ``sigmoid(b)``), and a starting state."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return no_zeros(torch.randn(*shape, generator=gen))

    inputs = {
        "q": draw(1, t, HK, DK).repeat_interleave(HV // HK, dim=2).to(device, dtype),
        "k": draw(1, t, HK, DK).repeat_interleave(HV // HK, dim=2).to(device, dtype),
        "v": draw(1, t, HV, DV).to(device, dtype),
        "g": (-torch.nn.functional.softplus(draw(1, t, HV)) * 0.5).to(device, torch.float32),
        "beta": torch.sigmoid(draw(1, t, HV)).to(device, dtype),
        "initial_state": (draw(1, HV, DK, DV) * 0.1).to(device, torch.float32) if state else None,
    }
    return inputs


def split(inputs: dict[str, Any], at: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first ``at`` tokens and the rest (the second part without a starting state)."""
    first = {k: (v[:, :at] if k != "initial_state" else v) for k, v in inputs.items()}
    rest = {k: (v[:, at:] if k != "initial_state" else None) for k, v in inputs.items()}
    return first, rest


class GdnCalls:
    """The gate's candidate, oracle and same-dtype reference (the baseline), called through
    the contract (``pytest_dflash.routes.families.GatedDeltaRule``)."""

    def __init__(self, gate: GateContext) -> None:
        self.name = gate.route.name
        self.impl, self.oracle, self.reference = gate.impl, gate.oracle, gate.baseline

    @staticmethod
    def call(obj: Any, op: str, inputs: dict[str, Any]) -> tuple[Any, Any]:
        return getattr(obj, op)(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                inputs["beta"], inputs["initial_state"], True, True)

    def candidate(self, op: str, inputs: dict[str, Any], *, label: str) -> tuple[Any, Any]:
        """The candidate's call; it must record hits on itself (its own op, or the dispatch
        record of an op it leaves to the baseline)."""
        with hits.counting() as delta:
            out = self.call(self.impl, op, inputs)
        if delta.route(self.name) == 0:
            raise AssertionError(f"{label}: {self.name}.{op} recorded no hit on itself (got "
                                 f"{delta.as_json()}): silent fallback or uncounted call?")
        return out


def judge(got: tuple[Any, Any], want: tuple[Any, Any], ref: tuple[Any, Any], *,
          gate: GateContext, dtype: torch.dtype, label: str) -> list[ParityResult]:
    """Output and final state each against the oracle (three-way rule, the baseline's result
    as the reference), with fla's measure beside our bound."""
    results = []
    for part, i in (("output", 0), ("final state", 1)):
        if want[i] is None:
            continue
        assert got[i] is not None, f"{label}: the candidate returned no {part}"
        result = check_parity(got[i], want[i], ref[i], policy=gate.policy, dtype=dtype,
                              label=f"{label} {part}")
        results.append(result)
    return results


def fla_figures(results: list[ParityResult], anchor: float) -> dict[str, Any]:
    """fla's measure (RMS(diff) / RMS(ref) = our relative L2) of every case, with fla's own
    figure and our bound, for the report."""
    return {"fla_measure": "RMS(candidate - oracle) / RMS(oracle)", "fla_anchor": anchor,
            "fla_ratio": {r.label: r.rel_l2 for r in results},
            "fla_ratio_worst": max(r.rel_l2 for r in results),
            "our_bound": {r.label: r.rel_l2_limit for r in results}}


class SpeedPair:
    """The speed gate's prefill chunk of ``t`` tokens (no starting state: a cold prefill),
    candidate and baseline, built alike in the gate's process and in each timing worker."""

    def __init__(self, gate: GateContext, t: int) -> None:
        self.impl, self.base = gate.impl, gate.baseline
        self.dtype = gate.dtype
        self.inputs = make_inputs(t, seed=gate.seed("gdn speed", t), dtype=self.dtype,
                                  device=gate.device, state=False)
        self.label = (f"gated delta rule prefill T={t} Hk={HK} Hv={HV} D={DK} "
                      f"{str(self.dtype).removeprefix('torch.')}")
        self.out: dict[str, Any] = {}

    def _run(self, obj: Any, side: str) -> None:
        self.out[side] = GdnCalls.call(obj, "chunk", self.inputs)

    def candidate(self) -> None:
        self._run(self.impl, "candidate")

    def baseline(self) -> None:
        self._run(self.base, "baseline")

    def check_output(self, policy: Any) -> None:
        """What is timed is the recurrence: one call of each, compared."""
        self.candidate()
        self.baseline()
        for i, part in ((0, "output"), (1, "final state")):
            parity = check_parity(self.out["candidate"][i], self.out["baseline"][i].double(),
                                  None, policy=policy, dtype=self.dtype,
                                  label=f"{self.label} {part}: candidate vs baseline")
            assert parity.ok, parity.message()


def speed_pair(ctx: Any, *, route: str, t: int) -> Any:
    """Timing-worker builder of the linear.gdn speed gate."""
    from pytest_dflash.measure.timing_pool import TimedPair

    pair = SpeedPair(ctx.gate(route, "speed"), t)
    return TimedPair(pair.candidate, pair.baseline)
